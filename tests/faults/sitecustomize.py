"""Test-only fault injection for subprocess runs: put this directory on ``PYTHONPATH`` and set

- ``BOOST_JAX_FAULT_UNREADABLE=<process>:<step>[:<times>]``: that process's reads of
  checkpoint ``<step>``'s arrays fail (an I/O error seen by one host only), every time or the
  first ``<times>``;
- ``BOOST_JAX_FAULT_KILL=<step>:<moment>``: the process kills itself (SIGKILL) while saving
  checkpoint ``<step>``: ``meta`` -- arrays written, metadata not; ``commit`` -- everything
  written, the temporary directory not yet renamed (on an object store: the commit marker not
  yet written);
- ``BOOST_JAX_FAULT_HANG=<marker file>``: every checkpoint save hangs (as a collective waiting
  for a dead process would), after creating the marker file;
- ``BOOST_JAX_FAULT_STEP_HANG=<step>``: dispatching train step ``<step>`` hangs (in
  ``_hung_step``), as a step whose collective waits for a dead peer would;
- ``BOOST_JAX_FAULT_SLOW=<seconds>``: compiling the train step and the first checkpoint save
  each take ``<seconds>`` longer;

Nothing here is imported by boost_jax itself.
"""

import os

_UNREADABLE = os.environ.get("BOOST_JAX_FAULT_UNREADABLE")
_KILL = os.environ.get("BOOST_JAX_FAULT_KILL")
_HANG = os.environ.get("BOOST_JAX_FAULT_HANG")
_STEP_HANG = os.environ.get("BOOST_JAX_FAULT_STEP_HANG")
_SLOW = os.environ.get("BOOST_JAX_FAULT_SLOW")

if _HANG:
    import time
    from pathlib import Path

    from boost_jax.checkpointing import checkpointer as checkpoint

    def _hang(self, *args, **kwargs):
        Path(_HANG).touch()
        while True:
            time.sleep(3600)

    checkpoint.Checkpointer.save = _hang

if _UNREADABLE or _KILL:
    import errno
    import signal
    from pathlib import Path

    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.path import atomicity

    def _step_of(path) -> str:
        return Path(str(path)).parent.name.split(".")[0]

    if _UNREADABLE:
        _proc, _step, *_times = _UNREADABLE.split(":")
        _failures = [int(_times[0]) if _times else 1 << 30]
        _restore = ocp.StandardCheckpointHandler.restore

        def restore(self, directory, *args, **kwargs):
            import jax

            if (jax.process_index() == int(_proc) and _step_of(directory) == _step
                    and _failures[0] > 0):
                _failures[0] -= 1
                raise OSError(errno.EIO, "Input/output error (injected)", str(directory))
            return _restore(self, directory, *args, **kwargs)

        ocp.StandardCheckpointHandler.restore = restore

    if _KILL:
        _kstep, _moment = _KILL.split(":")

        def _die():
            os.kill(os.getpid(), signal.SIGKILL)

        if _moment == "meta":
            _save_fn = ocp.JsonCheckpointHandler._save_fn

            async def save_fn(self, x, directory):
                if _step_of(directory) == _kstep:
                    _die()
                return await _save_fn(self, x, directory)

            ocp.JsonCheckpointHandler._save_fn = save_fn
        else:
            def _killing(finalize):
                async def killing_finalize(self, *args, **kwargs):
                    if Path(str(self.get_final())).name == _kstep:
                        _die()
                    return await finalize(self, *args, **kwargs)
                return killing_finalize

            for _cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
                _cls.finalize = _killing(_cls.finalize)

if _STEP_HANG or _SLOW:
    import time

    from boost_jax.checkpointing import checkpointer as checkpoint
    from boost_jax.train import step

    _compile = step.compile_train_step

    def _hung_step():
        while True:
            time.sleep(3600)

    def compile_train_step(*args, **kwargs):
        if _SLOW:
            time.sleep(float(_SLOW))
        fn, calls = _compile(*args, **kwargs), [0]

        def stepped(*a, **k):
            calls[0] += 1
            if _STEP_HANG and calls[0] == int(_STEP_HANG):
                _hung_step()
            return fn(*a, **k)

        return stepped

    step.compile_train_step = compile_train_step  # before train/loop.py imports it

    if _SLOW:
        _save, _saves = checkpoint.Checkpointer.save, [0]

        def slow_save(self, *args, **kwargs):
            _saves[0] += 1
            if _saves[0] == 1:
                time.sleep(float(_SLOW))
            return _save(self, *args, **kwargs)

        checkpoint.Checkpointer.save = slow_save
