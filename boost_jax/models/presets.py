"""Model size presets, selectable with ``Model.size``; every field can be overridden.

Sources: CoLA's ``cola_configs/cola_{60m,130m,350m}.json`` and the
BOOST paper's appendix table for 1B-30B (vocab 32000, tied embeddings, MHA, rank d/4).
``tiny`` is the test size and ``small`` the size of the default ``python -m boost_jax.train``
run (a few million parameters, trains in minutes on a CPU).
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # test size: every test model derives from this one
    "tiny": dict(d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=176, vocab_size=512,
                 tie_embeddings=False),
    # the default run on the bundled corpus (byte-level BPE with 4096 tokens)
    "small": dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=688, vocab_size=4096,
                  tie_embeddings=True),
    # CoLA's LLaMA configs (C4 with the T5 tokenizer in the paper; 32000 here)
    "60m": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1376, rank=128,
                vocab_size=32000, tie_embeddings=False, only_lr_act=False),
    "130m": dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048, rank=256,
                 vocab_size=32000, tie_embeddings=False, only_lr_act=False),
    "350m": dict(d_model=1024, n_layers=24, n_heads=16, n_kv_heads=16, d_ff=2736, rank=256,
                 vocab_size=32000, tie_embeddings=False, only_lr_act=True),
    # the BOOST paper's LLaMA-style sizes
    "1b": dict(d_model=2048, n_layers=24, n_heads=32, n_kv_heads=32, d_ff=5472, rank=512,
               vocab_size=32000, tie_embeddings=True),
    "3b": dict(d_model=3072, n_layers=28, n_heads=24, n_kv_heads=24, d_ff=8192, rank=768,
               vocab_size=32000, tie_embeddings=True),
    "7b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008, rank=1024,
               vocab_size=32000, tie_embeddings=True),
    "13b": dict(d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, d_ff=13824, rank=1280,
                vocab_size=32000, tie_embeddings=True),
    "30b": dict(d_model=8192, n_layers=36, n_heads=64, n_kv_heads=64, d_ff=22016, rank=2048,
                vocab_size=32000, tie_embeddings=True),
}
