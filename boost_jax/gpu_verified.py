"""What has passed its parity test on a real GPU in this repository: a dated record that the
``auto`` defaults read.

A GPU-only path (a Triton kernel, cuDNN's packed-sequence attention) is built and checked on
CPU -- in Triton's interpreter, in the program lowered for CUDA -- but that is not the GPU
running it. ``auto`` chooses such a path only after its GPU parity test has passed here and
the result is written into :data:`RECORD` (by hand, from a GPU session's ``summary.txt``; see
docs, "GPU hosts"). Until then ``auto`` takes the XLA path and the GPU-only one stays opt-in.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Verified:
    """One passed GPU parity test: when, on which GPU and JAX, and which test."""

    date: str  # ISO date of the run
    gpu: str  # e.g. "NVIDIA H200"
    jax: str  # jax version of the run
    test: str  # the pytest node id that passed


#: the GPU-only paths, each with the test that verifies it on a GPU
PATHS = {
    "triton_kernels": "tests/kernels/test_triton_gpu.py",
    "cudnn_attention": "tests/models/test_attention_gpu.py::test_cudnn_attention_matches_reference",
    "cudnn_packed_attention": "tests/models/test_attention_gpu.py",
}

#: path -> its passed GPU parity test (launch/gpu_session.sh's ``gputests``, read off its
#: summary.txt; docs/BENCHMARKS.md, "On a GPU"). Not recorded, and why: ``triton_kernels`` --
#: the kernels' own tests passed on the H200 of 2026-11-28, the bf16 BTP step with them did
#: not run (the test asked for the statistic in lanes, which the kernels do not read; fixed,
#: not yet re-run); ``cudnn_packed_attention`` -- the packed test over every row did not run
#: (it passed no bound; fixed, not yet re-run), though the packed rows of
#: tests/parallel/test_plans_gpu.py and the over-the-bound test passed.
RECORD: dict[str, Verified] = {
    "cudnn_attention": Verified(
        "2026-11-28", "NVIDIA H200", "0.11.2",
        "tests/models/test_attention_gpu.py::test_cudnn_attention_matches_reference"),
}


def verified(path: str) -> Verified | None:
    """The recorded GPU parity result of ``path`` (a key of :data:`PATHS`), or ``None``."""
    if path not in PATHS:
        raise KeyError(f"{path!r} is not a GPU-only path ({', '.join(PATHS)})")
    return RECORD.get(path)
