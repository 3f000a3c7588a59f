"""Record ``tests/golden/cola_protocol/`` from the CoLA authors' own training code.

Run it in an environment with torch and transformers 4.53.3 (the newest release the official
code imports) and a checkout of github.com/alvin-zyl/CoLA (recorded at commit 91ff0d1)::

    python tests/golden/make_cola_protocol.py --cola_repo=PATH/TO/CoLA

It writes, into ``tests/golden/cola_protocol/`` (``--out``):

* ``train.jsonl``, ``validation.jsonl`` -- a small C4-like corpus (``{"text": ...}`` lines,
  generated here from a fixed word list and seed; some documents longer than a row);
* ``tokenizer.json`` -- a word-level tokenizer with t5's special ids (``<pad>`` 0, ``</s>`` 1,
  ``<unk>`` 2) whose template appends ``</s>``, as t5-base's does;
* ``model/`` -- the initial weights: the authors' ``ColaForCausalLM`` built from
  ``model/config.json`` (their ``ColaConfig``, ``only_lr_act`` false as in cola_60m.json) under
  ``torch.manual_seed(SEED)``, saved with ``save_pretrained``;
* ``record.json`` -- what their code did, in float32 on the CPU: every batch's ``input_ids``
  and ``attention_mask``, and per update the applied learning rate, the training objective
  (the sum of the micro-batches' ``loss / gradient_accumulation``), the gradient norm before
  clipping, and after ``STEPS`` updates every parameter's norm and their ``evaluate_model`` on
  the validation corpus.

What runs unmodified, imported from the checkout: ``cola.ColaConfig`` and
``cola.ColaForCausalLM`` (the model and its loss), ``pretraining_utils.dataloader.
PreprocessedIterableDataset`` (the rows), ``pretraining_utils.training_utils.build_optimizer``
and ``get_scheculer`` (torch AdamW in one group; the cyclical cosine with warm-up) and
``main.evaluate_model`` (the evaluation's arithmetic). What is re-stated, because ``main.main``
needs torchrun, CUDA, wandb and the C4 stream: the loop body of ``main.py`` lines 497-546
(labels with ``pad -> -100``, lines 512-515; ``loss / gradient_accumulation``, 518-521; the
update every ``gradient_accumulation`` micro-batches, 523; ``clip_grad_norm_``, 527-528;
``optimizer.step(); scheduler.step(); optimizer.zero_grad()``, 541-544; the stop test
``update_step > num_training_steps``, 505) and their data loader's construction (lines
316-321, over this corpus instead of the shuffled C4 stream). The loop is stopped after
``STEPS + 1`` micro-batch groups' losses: their stop test admits an extra update at the
cosine's wrapped-around start (learning rate x 1e-7), which boost_jax does not make, so the
evaluation is the one their loop runs at ``update_step == STEPS`` (``eval_every``, line 593),
before it.

``bitsandbytes`` (imported by training_utils.py for 8-bit Adam, unused here) is replaced by an
empty module. Rerunning reproduces every file bit for bit (one thread, deterministic
algorithms).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np

SEED = 0
SEQ_LEN = 32  # --max_length
BATCH = 2  # --batch_size (rows per GPU micro-batch)
TOTAL_BATCH = 4  # --total_batch_size: gradient_accumulation = 2 on one process
STEPS = 20  # --num_training_steps
RUN = {"lr": 6e-3, "weight_decay": 0.01, "grad_clipping": 0.5, "warmup_steps": 5,
       "min_lr_ratio": 0.1, "optimizer": "adamw", "scheduler": "cosine"}  # cola60m.sh but sizes
MODEL = {"architectures": ["ColaForCausalLM"], "model_type": "cola", "bos_token_id": 0,
         "eos_token_id": 1, "pad_token_id": 0, "hidden_act": "silu", "hidden_size": 32,
         "intermediate_size": 64, "initializer_range": 0.02, "num_attention_heads": 4,
         "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "vocab_size": 160, "rank": 8,
         "only_lr_act": False}  # cola_configs/cola_60m.json's fields, shrunk
SPECIALS = ("<pad>", "</s>", "<unk>")  # t5's ids 0, 1, 2
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from "
         "at which but have an they you were her she there one all we their has been will "
         "would who so if more when can no what said its into than them only other some new "
         "time these two may first then do any like my now over such our man me even most "
         "made after also did many before must through back years where much your way well "
         "down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day "
         "same another know while last might us great old year off come since against go "
         "came right used").split() + [".", ","]
DOCS = {"train": 88, "validation": 8}


def corpus(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` documents of 1 to 60 words (sentences of 4-12 words; a row holds 31 tokens)."""
    docs = []
    for _ in range(n):
        words: list[str] = []
        target = int(rng.integers(1, 61))
        while len(words) < target:
            sentence = rng.choice(len(WORDS) - 2, int(rng.integers(4, 13)))
            words += [WORDS[i] for i in sentence] + [WORDS[-2]]
        docs.append(" ".join(words[:target]))
    return docs


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate([*SPECIALS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.save(str(path))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cola_repo", required=True, help="a checkout of alvin-zyl/CoLA")
    parser.add_argument("--out", default=str(Path(__file__).parent / "cola_protocol"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    (out / "model").mkdir(parents=True, exist_ok=True)

    import torch
    import torch.distributed as dist
    import transformers  # before the stub: transformers probes for bitsandbytes

    sys.modules.setdefault("bitsandbytes", types.ModuleType("bitsandbytes"))
    sys.path.insert(0, str(Path(args.cola_repo).resolve()))
    import main as cola_main
    from cola import ColaConfig, ColaForCausalLM
    from pretraining_utils import training_utils
    from pretraining_utils.dataloader import PreprocessedIterableDataset

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rng = np.random.default_rng(SEED)
    texts = {split: corpus(rng, n) for split, n in DOCS.items()}
    for split, docs in texts.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                    for d in docs))
    write_tokenizer(out / "tokenizer.json")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), pad_token="<pad>", eos_token="</s>",
        unk_token="<unk>", model_max_length=SEQ_LEN)
    (out / "model" / "config.json").write_text(json.dumps(MODEL, indent=1) + "\n")

    torch.manual_seed(SEED)  # main.py line 185
    model = ColaForCausalLM(ColaConfig.from_pretrained(str(out / "model")))  # lines 353-354
    model.save_pretrained(str(out / "model"))
    (out / "model" / "config.json").write_text(json.dumps(MODEL, indent=1) + "\n")
    model.train()

    accumulation = TOTAL_BATCH // BATCH  # main.py lines 214-216, world_size 1
    opt_args = argparse.Namespace(optimizer=RUN["optimizer"], lr=RUN["lr"],
                                  weight_decay=RUN["weight_decay"], beta1=0.0)
    trainable = [p for p in model.parameters() if p.requires_grad]  # line 385
    optimizer = training_utils.build_optimizer(model, trainable, opt_args)  # line 388
    scheduler = training_utils.get_scheculer(  # lines 394-400
        optimizer=optimizer, scheduler_type=RUN["scheduler"], num_training_steps=STEPS,
        warmup_steps=RUN["warmup_steps"], min_lr_ratio=RUN["min_lr_ratio"])

    def loader(docs: list[str]):  # lines 316-321
        rows = PreprocessedIterableDataset([{"text": d} for d in docs], tokenizer,
                                           batch_size=BATCH, max_length=SEQ_LEN)
        return torch.utils.data.DataLoader(rows, batch_size=None, num_workers=0)

    pad_idx = tokenizer.pad_token_id  # line 484
    record = {"cola_commit": None, "seq_len": SEQ_LEN, "batch_size": BATCH,
              "total_batch_size": TOTAL_BATCH, "steps": STEPS, **RUN, "pad_id": pad_idx,
              "batches": [], "updates": []}
    update_step, global_step, objective = 0, 0, 0.0
    for batch in loader(texts["train"]):  # the loop of lines 497-546
        global_step += 1
        if update_step >= STEPS + 1:  # stop before the extra update (see the docstring)
            break
        record["batches"].append({k: batch[k].tolist() for k in ("input_ids",
                                                                 "attention_mask")})
        batch["labels"] = batch["input_ids"].clone()
        batch["labels"][batch["labels"] == pad_idx] = -100
        loss = model(**batch).loss
        scaled_loss = loss / accumulation
        scaled_loss.backward()
        objective += scaled_loss.item()
        if global_step % accumulation != 0:
            continue
        norm = torch.nn.utils.clip_grad_norm_(trainable, RUN["grad_clipping"])
        record["updates"].append({"lr": optimizer.param_groups[0]["lr"], "loss": objective,
                                  "grad_norm": norm.item()})
        objective = 0.0
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        update_step += 1
        if update_step == STEPS:  # line 593 with --eval_every STEPS
            model.eval()
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29511", rank=0,
                                    world_size=1)
            loss, tokens = cola_main.evaluate_model(
                model, None, pad_idx, 0, 1, "cpu", BATCH, loader(texts["validation"]))
            dist.destroy_process_group()
            record["eval"] = {"loss": loss, "tokens": tokens,
                              "batches": -(-DOCS["validation"] // BATCH)}
            record["param_norms"] = {n: p.norm().item() for n, p in model.named_parameters()}
            model.train()
    if len(record["updates"]) != STEPS + 1:
        raise SystemExit(f"the corpus ran out after {len(record['updates'])} updates")
    record["cola_commit"] = _commit(Path(args.cola_repo))
    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}: {STEPS + 1} losses {record['updates'][0]['loss']:.6f} -> "
          f"{record['updates'][-1]['loss']:.6f}, eval {record['eval']['loss']:.6f}")


def _commit(repo: Path) -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
