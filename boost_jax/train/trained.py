"""A trained model read back from a run's workdir, on one process: its config, parameters and
tokenizer (what export, generation and evaluation start from).

Checkpoints hold the canonical layout (block parameters ``[L, ...]``, global shapes), whatever
mesh wrote them, so any run's checkpoint loads here without its mesh. Only the parameters are
read (orbax's partial restore skips the optimizer moments); every chunk's checksum is verified
on read and every value must be finite.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from boost_jax.config import Config, ConfigError, Data, Model, Parallel, Train
from boost_jax.data import tokenizer as tokenizers
from boost_jax.models.decoder import abstract_model
from boost_jax.models.init import unflatten
from boost_jax.train.read_failures import root_cause

GROUPS = {"Model": Model, "Parallel": Parallel, "Train": Train, "Data": Data}


@dataclasses.dataclass
class Trained:
    """``params``: fp32 numpy arrays, nested dict, canonical layout (models/decoder.py)."""

    config: Config
    params: dict
    step: int
    workdir: Path

    @property
    def model(self) -> Model:
        return self.config.model

    def tokenizer(self) -> tokenizers.Tokenizer:
        """The tokenizer of the run's dataset (prepared on first use for a bundled corpus)."""
        from boost_jax.data.pipeline import open_dataset

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


def checkpoint_steps(workdir: Path) -> list[int]:
    """Committed checkpoint steps of ``workdir``, oldest first."""
    root = workdir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir()
                  if p.name.isdigit() and (p / "state").is_dir() and (p / "meta").is_dir())


def trained_config(workdir: str | Path, step: int | None = None) -> tuple[Config, int]:
    """The config of ``workdir``'s checkpoint ``step`` (default: the newest) and that step,
    from the checkpoint's metadata alone (JAX's backends are not started, so the devices a
    mesh needs can still be requested). Raises :class:`ConfigError` (one line) for a missing
    workdir, no checkpoint, an unknown step or unreadable metadata."""
    workdir = Path(workdir).absolute()  # orbax takes absolute paths only
    if not workdir.is_dir():
        raise ConfigError(f"--workdir={workdir} does not exist")
    steps = checkpoint_steps(workdir)
    if not steps:
        raise ConfigError(f"--workdir={workdir} holds no checkpoint (train first: python -m "
                          f"boost_jax.train --workdir={workdir})")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"--step={step}: {workdir} has checkpoints at steps "
                          f"{', '.join(map(str, steps))}")
    path = workdir / "checkpoints" / str(step) / "meta"
    try:
        meta = ocp.JsonCheckpointHandler().restore(path, args=ocp.args.JsonRestore())
        return config_from_dict(meta["config"]), step
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"checkpoint {path.parent}: unreadable metadata ({err})") from None
    except Exception as err:  # orbax raises many types on a damaged file
        raise ConfigError(f"checkpoint {path.parent}: metadata could not be read "
                          f"({' '.join(str(err).split())[:200]})") from None


def load_trained(workdir: str | Path, step: int | None = None) -> Trained:
    """The parameters of ``workdir``'s checkpoint ``step`` (default: the newest), on one device.

    Raises :class:`ConfigError` (one line) as :func:`trained_config` does, and for a damaged
    checkpoint.
    """
    workdir = Path(workdir).absolute()
    config, step = trained_config(workdir, step)
    params = read_params(workdir / "checkpoints" / str(step) / "state", config.model)
    return Trained(config, params, step, workdir)


def read_params(state_dir: Path, model: Model) -> dict:
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

