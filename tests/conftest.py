"""Test setup: 8 simulated CPU devices, parsed absl flags, a compilation cache, small data.

Everything here runs before JAX is imported by any test module.
"""

import os
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path


def _jaxlib_minor() -> int:
    """jaxlib's minor version (10 for 0.10.2), read without importing it: XLA reads its flags
    when JAX starts its backends."""
    return int(version("jaxlib").split(".")[1])


# the suite runs on 8 simulated CPU devices; on a GPU host BOOST_JAX_GPU_TESTS=1 (for the tests
# marked `gpu`, tests/gpu.py) makes the GPU the default platform, the CPU devices a second one:
# jax's cuDNN attention lowers for, and checks the compute capability of, the default backend's
# devices (with the CPU first, 3 of the `gpu` tests failed on an H200, 2026-11-28)
os.environ.setdefault("JAX_PLATFORMS",
                      "cuda,cpu" if os.environ.get("BOOST_JAX_GPU_TESTS") == "1" else "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
# XLA:CPU's LLVM code generation at -O0: the suite checks programs (HLO, collectives, buffer
# sizes, numerics within stated tolerances), not CPU speed, and compiling dominates its time
# (a third of its CPU time saved on 2 cores). The optimized HLO and the buffer sizes are those
# of XLA's default level 3 (tests/test_suite_settings.py); subprocesses (the commands the tests
# start) inherit it; the commands and benchmarks outside the suite compile at XLA's default.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# On jaxlib 0.10 (CI's floor stack; measured there only) also XLA:CPU's legacy elemental
# emitters instead of its MLIR fusion emitters (jaxlib 0.12 has no such option): the MLIR
# emitters build a context and pattern sets per kernel, most of a compile's time (the floor
# stack's CPU time 3,270 s -> 1,930 s). They change XLA:CPU's fusion decisions, not the
# partitioned program: the collectives, the dots and the argument and output sizes are the
# default's, the temporary size within 0.1 % (tests/test_suite_settings.py).
if _jaxlib_minor() == 10 and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# LORO's exact step calls LAPACK inside XLA's own thread pool (parallel/loro_qr.py,
# lapack_threads_limited): as the entry points do (cli.limit_lapack_threads), before anything
# loads scipy's OpenBLAS
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path.home() / ".cache" / "boost_jax" / "jax_cache_tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from absl import flags  # noqa: E402

flags.FLAGS(sys.argv[:1], known_only=True)
flags.FLAGS.mark_as_parsed()

import gin  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])

REPO = Path(__file__).resolve().parents[1]


#: the longest test files, longest first: one worker's seconds on CI's floor / newest stack
#: (clean-clone ``.ci/run``, 2026-11-28). The workers take whole files (``--dist loadfile``) in
#: this order, then the others in collection order (pyproject.toml passes
#: ``--no-loadscope-reorder``, else pytest-xdist would order files by their count of tests):
#: longest first, so that the last files to start are short and neither worker idles long at
#: the end. An outdated entry costs only time.
LONGEST = (
    "tests/parallel/test_multiprocess.py",       # 178 / -
    "tests/checkpointing/test_object_store.py",  # 148 / -
    "tests/train/test_trainer.py",               # 135 / -
    "tests/compiled/test_gpu_report_layouts.py", # skipped / 109
    "tests/compiled/test_plan_verify_gpu.py",    # skipped / 62
    "tests/parallel/test_zero.py",               # 105 / 57
    "tests/parallel/test_remat.py",              # 103 / 101
    "tests/compiled/test_gpu_report.py",         # skipped / 99
    "tests/parallel/test_plans.py",              # 95 / 75
    "tests/train/test_parallel_runs.py",         # 93 / -
    "tests/parallel/test_communication.py",      # 89 / -
    "tests/checkpointing/test_checkpointer.py",  # 83 / -
    "tests/train/test_cli.py",                   # 79 / -
    "tests/parallel/test_pipeline.py",           # 78 / -
    "tests/train/test_step.py",                  # 71 / 28
    "tests/test_quickstart.py",                  # 65 / 57
    "tests/test_notebooks.py",                   # 54 / -
    "tests/train/test_elastic.py",               # 45 / -
    "tests/parallel/test_zero_dtypes.py",        # 25 / 42
    "tests/test_gpu_settings.py",                # 41 / -
    "tests/checkpointing/test_object_store_runs.py",# 40 / -
    "tests/bench/test_bench.py",                 # 37 / -
    "tests/parallel/test_packing.py",            # 36 / -
    "tests/models/test_math.py",                 # 32 / 33
    "tests/analysis/test_perf_model.py",         # 30 / -
)


def pytest_collection_modifyitems(items: list) -> None:
    """The files of :data:`LONGEST` first, in its order, the others after them in collection
    order (a stable sort: a file's tests stay together and in order)."""
    rank = {path: i for i, path in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(autouse=True)
def _clean_gin():
    """Gin bindings are global: every test starts and ends without any."""
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(autouse=True)
def _absl_logging():
    """absl's level and its handler's format and filters are global, and a command run in this
    process sets them (cli.setup_logging): every test ends with them as it found them."""
    from absl import logging

    handler = logging.get_absl_handler()
    saved = (logging.get_verbosity(), handler.formatter, list(handler.filters))
    yield
    logging.set_verbosity(saved[0])
    handler.setFormatter(saved[1])
    handler.filters[:] = saved[2]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared dataset: three bundled plays, byte-level BPE with 512 tokens."""
    import json
    import lzma

    from boost_jax.data.corpus import corpus_path
    from boost_jax.data.prepare import prepare

    root = tmp_path_factory.mktemp("data")
    with lzma.open(corpus_path("shakespeare"), "rt") as f:
        docs = [json.loads(line) for _, line in zip(range(3), f)]
    src = root / "plays.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    prepare([src], root / "prepared", tokenizer="bpe:512", eval_fraction=0.05)
    return root / "prepared"



@pytest.fixture(scope="session")
def packing_data(tmp_path_factory) -> Path:
    """A prepared synthetic corpus of short and long documents in several shards."""
    from boost_jax.data.prepare import prepare
    from boost_jax.data.synthetic import write_corpus

    root = tmp_path_factory.mktemp("packing")
    src = write_corpus(root / "src", 0.4, files=2, words=(3, 150))
    prepare([src], root / "prepared", tokenizer="bpe:512", eval_fraction=0.1, chunk_mb=0.05,
            chunks_per_shard=2, workers=0)
    return root / "prepared"



def _tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` with ``options`` for the test (a real full or read-only
    disk); the test is skipped, saying so, where mounting is not allowed (CI's machine allows
    root to)."""
    import subprocess

    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 512 KiB tmpfs: a real full disk for a tiny model's checkpoints."""
    yield from _tmpfs(tmp_path / "disk", "size=512k")


@pytest.fixture
def read_only_disk(tmp_path) -> Iterator[Path]:
    """A read-only tmpfs holding an empty directory ``ckpt``."""
    import subprocess

    disk = tmp_path / "ro"
    for path in _tmpfs(disk, "size=64k"):
        (path / "ckpt").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path
