"""``python -m boost_jax.export`` on a run's workdir: files, tokenizer, parity, one-line errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from boost_jax.checkpointing.checkpointer import Checkpointer
from boost_jax.commands.export import command
from boost_jax.config import Config, Data, Train
from boost_jax.data import tokenizer as tokenizers
from boost_jax.interop.formats import export_model, load_export
from boost_jax.testing import SINGLE, rel_err, tiny
from tests.interop.test_export import TOKENS, assert_params_equal, logits, random_params

TEXTS = ["ROMEO: But soft, what light through yonder window breaks?",
         "The king is dead. Long live the king!\nExeunt.", "ünïcödé 12345"]


def make_workdir(root, data, model, step=3, seq_len=32):
    """A run's workdir as the trainer leaves it: config.json and a checkpoint at ``step``
    (random parameters, saved by the trainer's Checkpointer; no training)."""
    config = Config(model, SINGLE, Train(steps=step, seq_len=seq_len, batch_size=8),
                    Data(path=str(data)))
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config.to_dict()))
    params = random_params(model)
    ckpt = Checkpointer(root / "checkpoints", keep=3, asynchronous=False)
    ckpt.save(step, {"params": params}, {"config": config.to_dict()}, wait=True)
    ckpt.close()
    return root, params


@pytest.fixture(scope="module")
def dense_run(tiny_data, tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("export") / "dense", tiny_data, tiny("dense"))


def test_dense_export_loads_in_transformers(dense_run, tiny_data, tmp_path, capsys):
    workdir, params = dense_run
    out = tmp_path / "hf"
    assert command(str(workdir), str(out)) == 0
    assert f"wrote {out}: step 3" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 32 and config["boost_jax"]["step"] == 3
    assert_params_equal(params, load_export(out)[1])

    transformers = pytest.importorskip("transformers")
    ours = tokenizers.load(tiny_data)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.eos_token == tokenizers.EOT and theirs.eos_token_id == ours.eos_id
    assert theirs(TEXTS)["input_ids"] == ours.encode_batch(TEXTS)
    assert theirs.decode(ours.encode_batch(TEXTS)[0]) == TEXTS[0]

    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()
    assert rel_err(got, logits(tiny("dense"), params)) <= 1e-5


def test_sentencepiece_tokenizer_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    spm = tokenizers.SentencePieceTokenizer(tokenizers.bundled_spm_path())
    cfg = tiny("dense", vocab_size=spm.vocab_size)
    export_model(cfg, random_params(cfg), tmp_path / "out", tokenizer=spm)
    assert (tmp_path / "out" / "tokenizer.model").is_file()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (theirs.bos_token_id, theirs.eos_token_id) == (spm.bos_id, spm.eos_id)
    # transformers' converted LlamaTokenizer differs from SentencePiece on runs of spaces only
    assert theirs(TEXTS)["input_ids"] == spm.encode_batch(TEXTS)
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (spm.bos_id, spm.eos_id)


def test_user_mistakes_are_one_line_errors(dense_run, tmp_path, capsys):
    workdir, _ = dense_run
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    cases = [
        (dict(workdir=str(tmp_path / "missing"), out=str(tmp_path / "o")), "does not exist"),
        (dict(workdir=str(tmp_path), out=str(tmp_path / "o")), "no checkpoint"),
        (dict(workdir=str(workdir), out=str(tmp_path / "o"), step=7), "checkpoints at steps 3"),
        (dict(workdir=str(workdir), out=str(tmp_path / "o"), fmt="cola"), "needs a cola model"),
        (dict(workdir=str(workdir), out=str(tmp_path / "o"), keep_factors=True), "no factors"),
        (dict(workdir=str(workdir), out=str(tmp_path / "taken"), overwrite=True), "never"),
        (dict(workdir=str(workdir), out=str(tmp_path / "o"), tokenizer=str(tmp_path / "t.json")),
         "--tokenizer"),
        (dict(workdir=None, out=str(tmp_path / "o")), "--workdir"),
    ]
    for kwargs, message in cases:
        assert command(**kwargs) == 2, kwargs
        err = capsys.readouterr().err.strip()
        assert err.startswith("boost_jax.export: error:") and "\n" not in err, err
        assert message in err, (message, err)
    assert not (tmp_path / "o").exists()


def test_command_line(dense_run, tmp_path):
    workdir, params = dense_run
    out = tmp_path / "plain"
    args = [sys.executable, "-m", "boost_jax.export", f"--workdir={workdir}", f"--out={out}",
            "--tokenizer=none"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "as llama" in done.stdout and not (out / "tokenizer.json").exists()
    assert_params_equal(params, load_export(out)[1])


@pytest.mark.slow
def test_trained_cola_run_exports_to_the_cola_layout(tiny_data, tmp_path):
    """Train a tiny cola model a few steps, export it (format auto) and read the CoLA layout
    back: the checkpoint's parameters, exactly; the same logits."""
    import jax

    from boost_jax.interop.cola import import_cola
    from boost_jax.train.loop import run
    from boost_jax.train.trained import load_trained

    model = tiny("cola", n_kv_heads=8)
    config = Config(model, SINGLE, Train(steps=4, seq_len=32, batch_size=8, log_every=100,
                                         eval_every=100, eval_batches=1),
                    Data(path=str(tiny_data)))
    run(config, tmp_path / "run", jax.devices()[:1])
    assert command(str(tmp_path / "run"), str(tmp_path / "out")) == 0
    cfg, params = import_cola(tmp_path / "out")
    trained = load_trained(tmp_path / "run")
    assert cfg.attn_rank == model.attn_rank and cfg.only_lr_act == model.only_lr_act
    assert_params_equal(trained.params, params)
    assert rel_err(logits(cfg, params), logits(model, trained.params)) == 0.0
