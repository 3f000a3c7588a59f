"""parallel/loro_qr.py as a library: it reads the process's settings and changes none."""

import os
import sys

from boost_jax.parallel import loro_qr

UNLOADED = "colorsys"  # a harmless module nothing here imports, standing in for scipy's LAPACK


def test_the_lapack_thread_check_reads_the_environment_only(monkeypatch):
    """No ``OPENBLAS_NUM_THREADS`` and the LAPACK not loaded yet: the check says so and leaves
    ``os.environ`` (and what is loaded) as they were -- setting it is the entry point's
    (boost_jax.cli.limit_lapack_threads); a value the user set counts."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setattr(loro_qr, "LAPACK_MODULE", UNLOADED)
    monkeypatch.delitem(sys.modules, UNLOADED, raising=False)
    before = dict(os.environ)
    assert loro_qr.lapack_threads_limited() is False
    assert dict(os.environ) == before and UNLOADED not in sys.modules
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    assert loro_qr.lapack_threads_limited()
