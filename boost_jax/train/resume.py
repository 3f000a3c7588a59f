"""Whether a checkpoint's configuration lets this run resume it, from each field's ``resume``
classification (boost_jax/config_fields.py, declared next to every field in config.py):

- ``MATCH`` (the checkpoint's tree or meaning: the model, the optimizer, the tokenizer, the
  data stream's format): a different value refuses the checkpoint with one line naming the
  field and the value the checkpoint was written with (:class:`ResumeMismatch`, exit code 2);
  nothing is read, moved or written.
- ``NOTE`` (the mesh, the plan, the schedule, the batch ...): allowed, with one warning each
  -- the run resumes but does not match an uninterrupted one bit for bit.
- ``FREE`` (the run's length, logging, eval and checkpoint cadence, paths): allowed silently.

A field that the checkpoint's config does not hold (written before the field existed) is
compared at its default.

The data is part of the run's identity too: a checkpoint records the fingerprint of the
dataset it was trained on (``meta["data_fingerprint"]``, data/manifest.py); a resume on a
dataset with another fingerprint (``Data.path`` re-prepared from other text, with another
tokenizer or eval split) is refused in one line unless the user says the change is intended
(``--allow_data_change``; :func:`check_data`). Checkpoints older than the record are not
checked.
"""

from __future__ import annotations

import dataclasses

from absl import logging

from boost_jax.checkpointing.read_failures import ResumeMismatch  # noqa: F401 (raised here)
from boost_jax.config import Config
from boost_jax.config_fields import MATCH, NOTE

_GROUPS = {"model": "Model", "parallel": "Parallel", "train": "Train", "data": "Data"}


@dataclasses.dataclass(frozen=True)
class Change:
    """A field whose value differs from the checkpoint's."""

    binding: str  # e.g. "Train.optimizer"
    saved: object  # the checkpoint's value
    now: object  # this run's value
    resume: str  # MATCH | NOTE | FREE


def changes(saved: dict, config: Config) -> list[Change]:
    """Every field of ``config`` whose value differs from ``saved`` (a ``Config.to_dict()``
    read back from a checkpoint), in the order of the config classes."""
    out = []
    for attr, group in _GROUPS.items():
        values = saved.get(group, {})
        for f in dataclasses.fields(getattr(config, attr)):
            now = getattr(getattr(config, attr), f.name)
            old = values.get(f.name, f.default)
            if isinstance(now, tuple) and isinstance(old, list):  # JSON has no tuples
                old = tuple(old)
            if old != now:
                out.append(Change(f"{group}.{f.name}", old, now, f.metadata["resume"]))
    return out


def check_resume(saved: dict, config: Config, where: str) -> None:
    """Refuse a checkpoint (of ``where``, a directory) whose config ``saved`` differs from
    ``config`` in a ``MATCH`` field (:class:`ResumeMismatch`); warn once per ``NOTE`` field
    that differs; see the module docstring."""
    diff = changes(saved, config)
    refused = [c for c in diff if c.resume == MATCH]
    if refused:
        raise ResumeMismatch(_refusal(refused, where))
    for c in diff:
        if c.resume == NOTE:
            logging.warning("resuming with %s=%r (the checkpoint used %r): the run will not "
                            "match an uninterrupted one bit for bit", c.binding, c.now, c.saved)
    old_h = saved.get("Train", {}).get("schedule_steps") or saved.get("Train", {}).get("steps")
    if old_h is not None and old_h != config.train.horizon:
        logging.warning("the learning-rate schedule now decays over %d steps (it was %d); set "
                        "Train.schedule_steps to keep one schedule across runs",
                        config.train.horizon, old_h)


def _refusal(refused: list[Change], where: str) -> str:
    """One line: the first field that must match (model choices first), and how many more."""
    first = min(refused, key=lambda c: (c.binding not in ("Model.arch", "Model.size"),
                                        not c.binding.startswith("Model.")))
    more = f" (and {len(refused) - 1} more field(s) that must match)" if len(refused) > 1 else ""
    if first.binding.startswith("Model."):
        return (f"the checkpoints in {where} were written for another model ({first.binding}="
                f"{first.saved!r}, now {first.now!r}){more}; use a new --workdir")
    return (f"{first.binding}={first.now!r} but the checkpoints in {where} were written with "
            f"{first.saved!r}{more}; use a new --workdir, or resume with "
            f"--gin_param=\"{first.binding}={first.saved!r}\"")


def check_data(saved_meta: dict, fingerprint: str, data_path: str, where: str,
               allow_change: bool) -> tuple[str, str] | None:
    """``(the checkpoint's fingerprint, this dataset's)`` when they differ and ``allow_change``;
    None when they agree (or the checkpoint has none); else :class:`ResumeMismatch`."""
    saved = saved_meta.get("data_fingerprint")
    if saved is None or saved == fingerprint:
        return None
    if not allow_change:
        raise ResumeMismatch(
            f"Data.path={data_path!r} holds other data than the checkpoints in {where} were "
            f"trained on (data fingerprint {fingerprint}, the checkpoints' {saved}: prepared "
            "from other text, with another tokenizer or eval split); resume on their data, use "
            "a new --workdir, or rerun with --allow_data_change to go on with this data (the "
            "change is recorded in metrics.jsonl)")
    logging.warning("resuming on other data than the checkpoint's (data fingerprint %s, was "
                    "%s): --allow_data_change; recorded in metrics.jsonl", fingerprint, saved)
    return saved, fingerprint
