"""A trained model read back from a run's checkpoints, on one process: its config, parameters and
tokenizer (what export, generation and evaluation start from).

The checkpoints are ``<workdir>/checkpoints`` or any ``checkpoint_dir`` the trainer was given
(``--checkpoint_dir``: a local directory, ``s3://bucket/prefix`` or ``gs://bucket/prefix``;
checkpointing/storage.py). A step counts only once committed: on a local disk a step directory
holding
``state`` and ``meta`` (orbax renames a save into place when complete), on an object store one
that also holds orbax's commit marker (a save is written in place there).

Checkpoints hold the canonical layout (block parameters ``[L, ...]``, global shapes), whatever
mesh wrote them, so any run's checkpoint loads here without its mesh. Only the parameters are
read (orbax's partial restore skips the optimizer moments); every chunk's checksum is verified
on read and every value must be finite.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from boost_jax.checkpointing import storage
from boost_jax.checkpointing.read_failures import root_cause
from boost_jax.config import Config, ConfigError, Data, Model, Parallel, Train
from boost_jax.data import tokenizer as tokenizers
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import unflatten

GROUPS = {"Model": Model, "Parallel": Parallel, "Train": Train, "Data": Data}


@dataclasses.dataclass
class Trained:
    """``params``: fp32 numpy arrays, nested dict, canonical layout (models/decoder.py);
    ``workdir``: the run's workdir, None when only its ``checkpoint_dir`` was given."""

    config: Config
    params: dict
    step: int
    workdir: Path | None
    checkpoint_dir: str = ""  # the directory (or object-store URL) the checkpoint was read from

    @property
    def model(self) -> Model:
        return self.config.model

    @property
    def source(self) -> str:
        """The run as a user named it: its workdir, else its checkpoint directory."""
        return str(self.workdir) if self.workdir is not None else self.checkpoint_dir

    def tokenizer(self) -> tokenizers.Tokenizer:
        """The tokenizer of the run's dataset (prepared on first use for a bundled corpus)."""
        from boost_jax.data.loader import open_dataset

        return tokenizers.load(open_dataset(self.config.data).path)


def config_from_dict(saved: dict) -> Config:
    """The :class:`Config` of a run's ``config.json`` (fields this version does not know are
    dropped with a warning; JSON lists become tuples)."""
    groups = {}
    for name, cls in GROUPS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        values = saved.get(name, {})
        unknown = sorted(set(values) - known)
        if unknown:
            logging.warning("ignoring %s fields this version does not have: %s", name,
                            ", ".join(unknown))
        groups[name] = cls(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in values.items() if k in known})
    return Config(groups["Model"], groups["Parallel"], groups["Train"], groups["Data"])


def checkpoint_steps(directory: str | os.PathLike) -> list[int]:
    """Committed checkpoint steps in the checkpoint directory ``directory`` (a run's
    ``<workdir>/checkpoints`` or its ``--checkpoint_dir``), oldest first. Names that are no
    step (``run/``, ``corrupt-4-...``, orbax's temporaries) are ignored."""
    root = storage.checkpoint_path(directory)
    if not root.is_dir():
        return []
    if not storage.on_object_store(root):
        return sorted(int(p.name) for p in root.iterdir()
                      if p.name.isdigit() and (p / "state").is_dir() and (p / "meta").is_dir())
    steps = []
    for p in root.iterdir():  # one listing per step: committed by the marker, written in place
        if p.name.isdigit() and {"state", "meta", storage.COMMIT_MARKER} <= {
                c.name for c in p.iterdir()}:
            steps.append(int(p.name))
    return sorted(steps)


def _checkpoints(workdir: str | os.PathLike | None, checkpoint_dir: str | os.PathLike | None
                 ) -> tuple[Path | None, epath.Path, str]:
    """``(workdir made absolute or None, the checkpoint directory, the flag naming it)``.
    ``checkpoint_dir`` (default ``<workdir>/checkpoints``) is a local path or an object
    store's URL; a local one, and a workdir that is read, must exist (ConfigError)."""
    if checkpoint_dir is not None and os.fspath(checkpoint_dir):
        root = storage.checkpoint_path(checkpoint_dir)  # one line for a scheme or a package
        flag = f"--checkpoint_dir={root}"
        if not storage.on_object_store(root) and not root.is_dir():
            raise ConfigError(f"{flag} does not exist")
        return (Path(workdir).absolute() if workdir else None), root, flag
    if not workdir:
        raise ConfigError("give the training run: --workdir=W (its checkpoints are "
                          "W/checkpoints) or --checkpoint_dir=D")
    workdir = Path(workdir).absolute()  # orbax takes absolute paths only
    if not workdir.is_dir():
        raise ConfigError(f"--workdir={workdir} does not exist")
    return workdir, storage.checkpoint_path(workdir / "checkpoints"), f"--workdir={workdir}"


def trained_config(workdir: str | os.PathLike | None = None, step: int | None = None,
                   checkpoint_dir: str | os.PathLike | None = None) -> tuple[Config, int]:
    """The config of checkpoint ``step`` (default: the newest) of ``checkpoint_dir`` (default:
    ``<workdir>/checkpoints``) and that step, from the checkpoint's metadata alone (JAX's
    backends are not started, so the devices a mesh needs can still be requested). Raises
    :class:`ConfigError` (one line) for a missing workdir or directory, no checkpoint, an
    unknown step or unreadable metadata."""
    config, step, _, _ = _config_at(workdir, step, checkpoint_dir)
    return config, step


def _config_at(workdir, step, checkpoint_dir) -> tuple[Config, int, Path | None, epath.Path]:
    workdir, root, flag = _checkpoints(workdir, checkpoint_dir)
    steps = checkpoint_steps(root)
    where = str(workdir) if flag.startswith("--workdir") else str(root)
    if not steps:
        raise ConfigError(f"{flag} holds no checkpoint (train first: python -m "
                          f"boost_jax.train {flag})")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"--step={step}: {where} has checkpoints at steps "
                          f"{', '.join(map(str, steps))}")
    path = root / str(step) / "meta"
    try:
        meta = ocp.JsonCheckpointHandler().restore(path, args=ocp.args.JsonRestore())
        return config_from_dict(meta["config"]), step, workdir, root
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"checkpoint {path.parent}: unreadable metadata ({err})") from None
    except Exception as err:  # orbax raises many types on a damaged file
        raise ConfigError(f"checkpoint {path.parent}: metadata could not be read "
                          f"({' '.join(str(err).split())[:200]})") from None


def load_trained(workdir: str | os.PathLike | None = None, step: int | None = None,
                 checkpoint_dir: str | os.PathLike | None = None) -> Trained:
    """The parameters of checkpoint ``step`` (default: the newest) of ``checkpoint_dir``
    (default: ``<workdir>/checkpoints``), on one device.

    Raises :class:`ConfigError` (one line) as :func:`trained_config` does, and for a damaged
    checkpoint.
    """
    config, step, workdir, root = _config_at(workdir, step, checkpoint_dir)
    params = read_params(root / str(step) / "state", config.model)
    return Trained(config, params, step, workdir, str(root))


def read_params(state_dir: epath.Path, model: Model) -> dict:
    """The ``params`` subtree of a saved train state as fp32 numpy arrays (checked finite)."""
    _, defs = abstract_model(model)
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = unflatten({p: jax.ShapeDtypeStruct(d.shape, np.float32, sharding=sharding)
                        for p, d in defs.items()})
    restore = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=sharding, global_shape=s.shape,
                                                          dtype=s.dtype), target)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        state = handler.restore(state_dir, args=ocp.args.PyTreeRestore(
            item={"params": target}, restore_args={"params": restore}, partial_restore=True))
    except Exception as err:  # orbax/tensorstore raise many types on damaged files
        raise ConfigError(f"checkpoint {state_dir.parent} could not be read: "
                          f"{' '.join(str(root_cause(err)).split())[:300]}") from None
    finally:
        handler.close()
    params = jax.tree.map(np.asarray, state["params"])
    bad = [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(params)
           if not np.isfinite(v).all()]
    if bad:
        raise ConfigError(f"checkpoint {state_dir.parent}: parameters are not finite: "
                          f"{', '.join(bad[:3])}")
    return params

