"""What every config field shares: its help text, whether a checkpoint written under another
value resumes, a type check of its value, and the one-line :class:`ConfigError` a bad value
raises; and :class:`Derived`, how a config group is made complete before it exists (used by
:mod:`boost_jax.config`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
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


def typed(cls: type, values: dict) -> dict:
    """``values`` (every field of config class ``cls``), each :func:`config_field` checked
    against its annotated type, with a tuple field's list (from JSON) as a tuple and a float
    field's integer as a float; else a ConfigError naming the binding."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if "resume" in f.metadata}
    out = dict(values)
    for name, value in values.items():
        if name not in fields:
            continue
        hint = hints[name]
        if typing.get_origin(hint) is tuple and isinstance(value, list):  # from JSON
            value = tuple(value)
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if not any(_accepts(k, value) for k in kinds):
            expected = " or ".join(_TYPE_NAMES.get(k) or _tuple_name(k) for k in kinds)
            raise ConfigError(f"{cls.__name__}.{name}={value!r} must be {expected}")
        out[name] = float(value) if float in kinds and isinstance(value, int) else value
    return out


class Derived(type):
    """The metaclass of the config groups: ``Group(...)`` is a factory. It binds the arguments
    to the dataclass's fields (defaults filled in), checks their types (:func:`typed`), lets
    the class fill in what follows from them (its ``derive(values) -> values`` classmethod: a
    preset's dimensions, a default rank, a warm-up length, ...), then makes the frozen
    instance complete -- it is never changed afterwards, so it is a sound ``lru_cache`` or
    static-argument key -- and ``__post_init__`` only validates. ``dataclasses.replace`` comes
    through here too, with every field given: ``derive`` fills only what is unset."""

    def __call__(cls, *args, **kwargs):
        values = _signature(cls).bind(*args, **kwargs)
        values.apply_defaults()
        values = typed(cls, dict(values.arguments))
        derive = getattr(cls, "derive", None)
        return super().__call__(**(derive(values) if derive else values))


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    """``cls``'s dataclass ``__init__`` signature without ``self``."""
    sig = inspect.signature(cls.__init__)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


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
