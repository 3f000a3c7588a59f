"""``python -m boost_jax.export``: a trained checkpoint as a directory other tools load.

    python -m boost_jax.export --workdir=runs/dense --out=export/dense   # LlamaForCausalLM
    python -m boost_jax.export --workdir=runs/svd --step=200 --out=export/svd --keep_factors
    python -m boost_jax.export --workdir=runs/cola --out=export/cola     # CoLA's ColaForCausalLM
    python -m boost_jax.export --checkpoint_dir=s3://bucket/run/checkpoints --out=export/run

The checkpoints are read from ``--checkpoint_dir``, what the trainer was given (a local
directory, ``s3://bucket/prefix`` or ``gs://bucket/prefix``; default:
``<workdir>/checkpoints``); given it, ``--workdir`` may be left out.

``--format`` (default ``auto``, which picks by ``Model.arch``): ``hf`` for dense and svd
(``LlamaForCausalLM``; svd multiplied out, or factored with ``--keep_factors``), ``cola`` for
cola (the CoLA repository's layout), ``lax`` for lax (factors, crossing gates, latent norm).
boost_jax/interop/formats.py documents every layout. The directory also holds the run's
tokenizer (``AutoTokenizer.from_pretrained`` loads it) unless ``--tokenizer`` names another
(a ``tokenizer.json``, a SentencePiece ``.model`` or a prepared data directory) or ``none``.

Any checkpoint loads, whatever mesh trained it (checkpoints hold the canonical layout), on
one process. The output is written beside ``--out`` and renamed into place when complete; an
existing ``--out`` is replaced only with ``--overwrite`` and only if it holds an export.

A user mistake (no workdir or checkpoint, an unknown ``--step``, a format the arch cannot
take, an ``--out`` that is taken) prints ``boost_jax.export: error: ...`` on one line and
exits with code 2; ``BOOST_JAX_DEBUG=1`` raises it with its traceback instead.
"""

from __future__ import annotations

from pathlib import Path

from absl import flags

from boost_jax.cli import define_checkpoint_dir_flag, run_app, user_error
from boost_jax.errors import ConfigError

PROG = "boost_jax.export"
FLAGS = flags.FLAGS
RUN_TOKENIZER, NO_TOKENIZER = "run", "none"


def define_flags() -> None:
    """The command's flags."""
    from boost_jax.interop.formats import FORMATS

    flags.DEFINE_string("workdir", None, "the training run's --workdir")
    define_checkpoint_dir_flag()
    flags.DEFINE_integer("step", None, "checkpoint step to export (default: the newest)")
    flags.DEFINE_string("out", None, "directory to write (created; see --overwrite)")
    flags.DEFINE_enum("format", "auto", FORMATS, "auto (by Model.arch) | hf "
                      "(LlamaForCausalLM: dense, svd) | cola (CoLA's ColaForCausalLM) | lax")
    flags.DEFINE_bool("keep_factors", False, "svd with --format=hf/auto: keep A and B "
                      "(the boost_svd layout) instead of multiplying them out (cola and lax "
                      "exports are always factored)")
    flags.DEFINE_bool("overwrite", False, "replace an existing export at --out")
    flags.DEFINE_string("tokenizer", RUN_TOKENIZER, "run (the run's dataset tokenizer) | none "
                        "| a tokenizer.json, SentencePiece .model or prepared data directory")


def load_tokenizer(spec: str, trained):
    """The tokenizer named by ``--tokenizer`` (``None`` for ``none``); ConfigError if absent."""
    from boost_jax.data import tokenizer as tokenizers

    if spec == NO_TOKENIZER:
        return None
    try:
        if spec == RUN_TOKENIZER:
            return trained.tokenizer()
        path = Path(spec)
        if path.is_dir():
            return tokenizers.load(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        is_json = path.suffix == ".json"
        return (tokenizers.HFTokenizer if is_json else tokenizers.SentencePieceTokenizer)(path)
    except ConfigError:
        raise
    except Exception as err:  # tokenizers and sentencepiece raise many types on a bad file
        raise ConfigError(f"--tokenizer={spec}: {' '.join(str(err).split())[:200]} (name one "
                          "with --tokenizer=PATH, or --tokenizer=none)") from None


def export(workdir: str | None, out: str | None, step: int | None = None, fmt: str = "auto",
           keep_factors: bool = False, overwrite: bool = False,
           tokenizer: str = RUN_TOKENIZER, checkpoint_dir: str | None = None):
    """Export checkpoint ``step`` of ``checkpoint_dir`` (default ``<workdir>/checkpoints``)
    to ``out``; returns the
    :class:`~boost_jax.interop.formats.Exported` and the checkpoint's step. Raises
    ConfigError (one line) on a user mistake, before writing anything."""
    from boost_jax.interop.formats import check_output, export_model, resolve_layout
    from boost_jax.train.trained import load_trained

    if not workdir and not checkpoint_dir:
        raise ConfigError("give the run to export: --workdir=RUN (or --checkpoint_dir=CKPT) "
                          "--out=DIR (see --help)")
    if not out:
        raise ConfigError("give the directory to write: --out=DIR (see --help)")
    check_output(Path(out), overwrite)  # fail before reading a large checkpoint
    trained = load_trained(workdir, step, checkpoint_dir)
    resolve_layout(trained.model, fmt, keep_factors)  # before preparing a tokenizer
    tok = load_tokenizer(tokenizer, trained)
    provenance = {} if trained.workdir is None else {"workdir": str(trained.workdir)}
    if checkpoint_dir:
        provenance["checkpoint_dir"] = trained.checkpoint_dir
    provenance["step"] = trained.step
    result = export_model(trained.model, trained.params, out, fmt, keep_factors, tok,
                          overwrite, max_positions=trained.config.train.seq_len,
                          provenance=provenance)
    return result, trained.step


def command(workdir: str | None, out: str | None, step: int | None = None, fmt: str = "auto",
            keep_factors: bool = False, overwrite: bool = False,
            tokenizer: str = RUN_TOKENIZER, checkpoint_dir: str | None = None) -> int:
    """:func:`export` with one-line errors; the exit code (0, or 2 on a user mistake)."""
    try:
        result, step = export(workdir, out, step, fmt, keep_factors, overwrite, tokenizer,
                              checkpoint_dir)
    except ConfigError as err:
        return user_error(PROG, err)
    loads = {"llama": "transformers.LlamaForCausalLM", "cola": "the CoLA repository's "
             "ColaForCausalLM", "svd_factored": "boost_jax.interop.formats.load_export",
             "lax": "boost_jax.interop.formats.load_export"}[result.layout]
    tok = f"{result.tokenizer} tokenizer" if result.tokenizer else "no tokenizer"
    print(f"wrote {result.path}: step {step} of {workdir or checkpoint_dir} as {result.layout} "
          f"({result.tensors} tensors, {result.nbytes / 2**20:.1f} MiB, {tok}); "
          f"loads with {loads}")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        return user_error(PROG, ConfigError(f"unexpected argument(s) {' '.join(argv[1:])} "
                                            "(see --help)"))
    return command(FLAGS.workdir, FLAGS.out, FLAGS.step, FLAGS.format, FLAGS.keep_factors,
                   FLAGS.overwrite, FLAGS.tokenizer, FLAGS.checkpoint_dir)


if __name__ == "__main__":
    define_flags()
    run_app(PROG, main)
