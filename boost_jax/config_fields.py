"""What every config field shares: its help text, whether a checkpoint written under another
value resumes, a type check of its value, and the one-line :class:`ConfigError` a bad value
raises (used by :mod:`boost_jax.config`)."""

from __future__ import annotations

import dataclasses
import types
import typing

from boost_jax.errors import ConfigError


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string",
               bool: "a boolean (True or False)", type(None): "None"}


def _accepts(kind: type, value) -> bool:
    if typing.get_origin(kind) is tuple:  # tuple[str, ...]
        item = typing.get_args(kind)[0]
        return isinstance(value, tuple) and all(_accepts(item, v) for v in value)
    if kind is type(None) or kind is str or kind is bool:
        return isinstance(value, kind)
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return numeric and (kind is float or isinstance(value, int))


def _tuple_name(kind) -> str:
    """``'a tuple of strings'`` for ``tuple[str, ...]``."""
    item = typing.get_args(kind)[0]
    return f"a tuple of {_TYPE_NAMES[item].removeprefix('a ').removeprefix('an ')}s"


def check_types(obj) -> None:
    """Every field holds a value of its annotated type (a float field takes an integer too,
    stored as a float); else a ConfigError naming the binding."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        hint = hints[f.name]
        value = getattr(obj, f.name)
        if typing.get_origin(hint) is tuple and isinstance(value, list):  # from JSON
            value = tuple(value)
            set_values(obj, **{f.name: value})
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if not any(_accepts(k, value) for k in kinds):
            expected = " or ".join(_TYPE_NAMES.get(k) or _tuple_name(k) for k in kinds)
            raise ConfigError(f"{type(obj).__name__}.{f.name}={value!r} must be {expected}")
        if float in kinds and isinstance(value, int):
            set_values(obj, **{f.name: float(value)})


# What a resumed run may do with a field whose value differs from the checkpoint's config
# (train/resume.py reads it; every field declares one):
MATCH = "must match"  # the checkpoint's tree or meaning: a different value is refused
NOTE = "changes the trajectory"  # allowed, with a warning: not bit-identical to one run
FREE = "may change"  # allowed silently: cadence, paths, the run's length
RESUME_KINDS = (MATCH, NOTE, FREE)


def config_field(default, help: str, resume: str):
    """A config field: its default, its one-line meaning (``--print_config`` shows it) and
    ``resume``, one of :data:`RESUME_KINDS`: what resuming a checkpoint written under another
    value of it does."""
    if resume not in RESUME_KINDS:
        raise ValueError(f"resume={resume!r} is not one of {RESUME_KINDS}")
    return dataclasses.field(default=default, metadata={"help": help, "resume": resume})


def set_values(obj, **kw) -> None:
    for k, v in kw.items():
        object.__setattr__(obj, k, v)


def unbound(cls, **values):
    """``cls(**values)`` with every other field at its dataclass default, whatever gin has
    bound: a fixed configuration (the paper's rows) that a run's ``--gin_param`` must not
    change (gin fills only the arguments a call leaves out)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)
                if f.init and f.default is not dataclasses.MISSING}
    return cls(**{**defaults, **values})
