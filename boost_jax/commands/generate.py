"""``python -m boost_jax.generate``: continue a prompt with a trained model.

    python -m boost_jax.generate --workdir=runs/default --prompt="ROMEO:"
    python -m boost_jax.generate --workdir=W --prompt="The king" --prompt="JULIET:" \\
        --temperature=0.8 --top_p=0.9 --num_samples=3 --seed=1 --max_new_tokens=100
    python -m boost_jax.generate --checkpoint_dir=s3://bucket/run/checkpoints --prompt="ROMEO:"

Loads the newest checkpoint of a training run (or ``--step``) on one device,
encodes each ``--prompt`` with the run's tokenizer, and prints the prompt and its continuation
on stdout: ``--max_new_tokens`` tokens at most, ending early at the tokenizer's end-of-text
token. ``--temperature=0`` (the default) is greedy decoding; a positive temperature samples
from the ``--top_p`` nucleus, the same text for the same ``--seed``. With several prompts or
``--num_samples`` each text is preceded by a ``=== prompt i, sample j ===`` line. Generation
uses a key/value cache (models/decode.py): the whole batch of prompts is prefilled in one call,
then one compiled step per token.

The checkpoints are read from ``--checkpoint_dir``, what the trainer was given (a local
directory, ``s3://bucket/prefix`` or ``gs://bucket/prefix``; default:
``<workdir>/checkpoints``); given it, ``--workdir`` may be left out.

A mistake (no such workdir, no checkpoint, an unknown ``--step``, an empty prompt, a bad
sampling setting) prints ``boost_jax.generate: error: ...`` on one line and exits with code 2;
``BOOST_JAX_DEBUG=1`` raises it with its traceback instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags

from boost_jax.cli import (
    define_checkpoint_dir_flag,
    enable_compilation_cache,
    run_app,
    user_error,
)
from boost_jax.config import DTYPES, ConfigError

PROG = "boost_jax.generate"
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags."""
    flags.DEFINE_string("workdir", None, "the training run's --workdir (holding checkpoints/)")
    define_checkpoint_dir_flag()
    flags.DEFINE_multi_string("prompt", [], "text to continue; repeat the flag for several")
    flags.DEFINE_integer("step", None, "checkpoint step to load (default: the newest)")
    flags.DEFINE_integer("max_new_tokens", 64, "most tokens generated per sample")
    flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sample at this temperature")
    flags.DEFINE_float("top_p", 1.0, "sampling: draw from the smallest set of most likely "
                       "tokens whose probability reaches top_p (1: all)")
    flags.DEFINE_integer("seed", 0, "sampling seed (the same seed gives the same text)")
    flags.DEFINE_integer("num_samples", 1, "samples per prompt (needs --temperature > 0)")
    flags.DEFINE_string("dtype", "float32", "compute and cache dtype: " + " | ".join(DTYPES))


def check_args(workdir: str | None, prompts: list[str], max_new_tokens: int, temperature: float,
               top_p: float, num_samples: int, dtype: str) -> None:
    """Raise :class:`ConfigError` (one line) on a bad flag value."""
    if not workdir:
        raise ConfigError("give the training run's --workdir (e.g. --workdir=runs/default) or "
                          "its --checkpoint_dir")
    if not prompts:
        raise ConfigError('give a --prompt to continue (e.g. --prompt="ROMEO:")')
    if not all(prompts):
        raise ConfigError("--prompt is empty; give some text to continue")
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens={max_new_tokens} must be a positive integer")
    if not temperature >= 0:
        raise ConfigError(f"--temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top_p={top_p} must be in (0, 1]")
    if num_samples < 1:
        raise ConfigError(f"--num_samples={num_samples} must be a positive integer")
    if num_samples > 1 and temperature == 0:
        raise ConfigError(f"--num_samples={num_samples} with --temperature=0 (greedy) gives "
                          "identical samples; set --temperature > 0")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")


def generate_texts(workdir: str | Path | None, prompts: list[str], step: int | None = None,
                   max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                   seed: int = 0, num_samples: int = 1, dtype: str = "float32",
                   checkpoint_dir: str | None = None) -> tuple[int, list[list[str]]]:
    """``(checkpoint step, texts)``: for each prompt its ``num_samples`` texts (the prompt and
    its continuation), from ``checkpoint_dir`` (default: ``<workdir>/checkpoints``). Raises
    :class:`ConfigError` on a user mistake."""
    import jax.numpy as jnp

    from boost_jax.models.decode import generate
    from boost_jax.train.trained import load_trained

    check_args(workdir or checkpoint_dir, prompts, max_new_tokens, temperature, top_p,
               num_samples, dtype)
    trained = load_trained(workdir, step, checkpoint_dir)
    tokenizer = trained.tokenizer()
    encoded = tokenizer.encode_batch(prompts)
    for text, ids in zip(prompts, encoded):
        if not ids:
            raise ConfigError(f"--prompt={text!r} encodes to no tokens; give some text")
    batch = [ids for ids in encoded for _ in range(num_samples)]
    stops = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    new = generate(trained.model, trained.params, batch, max_new_tokens, temperature, top_p,
                   seed, stops, jnp.dtype(dtype))
    texts = [tokenizer.decode(ids + out) for ids, out in zip(batch, new)]
    return trained.step, [texts[i:i + num_samples] for i in range(0, len(texts), num_samples)]


def command(workdir: str | None, prompts: list[str], **options) -> int:
    """:func:`generate_texts`, printed; returns the exit code (0, or 2 on a user mistake)."""
    try:
        step, texts = generate_texts(workdir, prompts, **options)
    except ConfigError as err:
        return user_error(PROG, err)
    print(f"{PROG}: {workdir or options.get('checkpoint_dir')} at step {step}", file=sys.stderr)
    several = len(texts) > 1 or len(texts[0]) > 1
    for i, samples in enumerate(texts, 1):
        for j, text in enumerate(samples, 1):
            if several:
                print(f"=== prompt {i}, sample {j} ===")
            print(text)
    return 0


def main(argv: list[str]) -> int:
    """The command: the flags are parsed; no positional arguments."""
    if len(argv) > 1:
        return user_error(PROG, ConfigError(f"unexpected arguments: {' '.join(argv[1:])} "
                                            '(the prompt goes in --prompt="...")'))
    enable_compilation_cache()
    return command(FLAGS.workdir, FLAGS.prompt, step=FLAGS.step,
                   max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
                   top_p=FLAGS.top_p, seed=FLAGS.seed, num_samples=FLAGS.num_samples,
                   dtype=FLAGS.dtype, checkpoint_dir=FLAGS.checkpoint_dir)


if __name__ == "__main__":
    define_flags()
    run_app(PROG, main)
