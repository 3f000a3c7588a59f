"""Gin text in and out of the :class:`~boost_jax.config.Config`: the one place that reads gin.

The config classes are plain dataclasses; here each is registered with gin under its name
(``Model``, ``Parallel``, ``Train``, ``Data``) as a configurable that returns the fields the
bindings set (:func:`bound`), so that a binding to an unknown field is gin's error, and an entry
point builds the :class:`Config` from them once (:func:`load_config`) and passes it down.

In: :func:`parse_gin` (files, then each ``--gin_param`` binding on its own, so an error names
the file or the binding) and :func:`load_config`. Out: :func:`operative_gin`, every field's
value as gin bindings (a run writes it to ``<workdir>/config.gin``; ``--gin_file`` on it
reproduces the run), and :func:`describe_fields`, the table ``--print_config`` prints (name,
type, default, what a resume may do with it, meaning: taken from the dataclasses, so it cannot
drift from them).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import tokenize
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path

import gin

from boost_jax.config import Config, ConfigError, Data, Model, Parallel, Train

GROUPS = {"model": Model, "parallel": Parallel, "train": Train, "data": Data}


def _register(cls: type):
    """A gin configurable named ``cls.__name__`` taking ``cls``'s fields (keyword-only, their
    defaults) and returning ``{field: value}`` for those a binding sets."""
    def given(**values):
        return values

    given.__signature__ = inspect.Signature([
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
        for f in dataclasses.fields(cls) if f.init])
    given.__name__ = given.__qualname__ = cls.__name__
    given.__doc__ = cls.__doc__
    return gin.external_configurable(given, name=cls.__name__, module=cls.__module__)


_BINDINGS = {cls: _register(cls) for cls in GROUPS.values()}


def bound(cls: type) -> dict:
    """The fields of config class ``cls`` that the parsed gin bindings set, with their
    values."""
    return _BINDINGS[cls]()


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split("\n")[0].split())


def parse_gin(files: Iterable[str] = (), bindings: Sequence[str] = (),
              search_paths: Iterable[str] = ()) -> None:
    """Parse gin files (as given, else under ``search_paths``), then each binding on its own;
    a missing file, a malformed binding or an unknown configurable or parameter is a
    ConfigError that names the file or the binding."""
    search_paths = list(search_paths)
    for path in search_paths:
        gin.add_config_file_search_path(path)  # for `include` inside the files
    for name in files:
        candidates = [Path(name)] + [Path(d) / name for d in search_paths]
        hit = next((c for c in candidates if c.is_file()), None)
        if hit is None:
            raise ConfigError(f"gin file {name!r} not found (looked in ., "
                              f"{', '.join(search_paths) or 'nowhere else'})")
        _gin(gin.parse_config_file, str(hit), where=f"gin file {name}")
    for binding in bindings:
        _gin(gin.parse_config, binding, where=f"--gin_param={binding}")
    gin.finalize()


def _gin(parse, text: str, where: str) -> None:
    try:
        parse(text)
    except Exception as err:  # gin raises many types (ValueError, TokenError, ...) on bad text
        why = _one_line(err)
        if isinstance(err, tokenize.TokenError):
            why = "unbalanced brackets or quotes"
        elif why.startswith("malformed node or string"):
            why = ("not a value: quote strings inside the binding, e.g. "
                   "--gin_param=\"Data.path='data/mine'\"")
        raise ConfigError(f"{where}: {why}{did_you_mean(why)}") from None


def did_you_mean(why: str) -> str:
    """`` Did you mean Model.arch?`` for gin's error about a misspelt group or field (the
    closest names, by :func:`difflib.get_close_matches`), else ``""``."""
    names = {cls.__name__: [f.name for f in dataclasses.fields(cls)] for cls in GROUPS.values()}
    if group := re.search(r"No configurable matching '([\w.]+)'", why):
        close = difflib.get_close_matches(group[1].rpartition(".")[2], names, n=1)
        return f" Did you mean {close[0]}?" if close else ""
    if field := re.search(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", why):
        close = difflib.get_close_matches(field[2], names.get(field[1], []), n=3, cutoff=0.7)
        return (" Did you mean " + " or ".join(f"{field[1]}.{c}" for c in close) + "?"
                if close else " python -m boost_jax.train --print_config lists every binding.")
    return ""


def load_config(**overrides) -> Config:
    """Build the validated :class:`Config` from the parsed gin bindings (plus ``overrides``,
    config groups by their :data:`GROUPS` name)."""
    made = {k: overrides.get(k) or cls(**bound(cls)) for k, cls in GROUPS.items()}
    return Config(**made)


def operative_gin(config: Config) -> str:
    """Every field of ``config`` as a gin binding (presets and defaults resolved), grouped,
    with each field's meaning as a comment. ``Parallel.grad_accum`` is commented out when
    ``Train.micro_batch_size`` sets it, so the file run on another ``Parallel.data`` derives
    its own."""
    lines = ["# The operative configuration of a boost_jax run: every field's value.",
             "# Reproduce the run with: python -m boost_jax.train --gin_file=<this file>"]
    for name in GROUPS:
        group = getattr(config, name)
        lines.append("")
        for f in dataclasses.fields(group):
            line = (f"{type(group).__name__}.{f.name} = {getattr(group, f.name)!r}"
                    f"  # {f.metadata['help']}")
            if (group is config.parallel and f.name == "grad_accum"
                    and config.train.micro_batch_size is not None):
                line = f"# {line} (follows Train.micro_batch_size)"
            lines.append(line)
    return "\n".join(lines) + "\n"


def _type_name(hint) -> str:
    if typing.get_origin(hint) is tuple:
        return f"tuple[{_type_name(typing.get_args(hint)[0])}, ...]"
    args = typing.get_args(hint) or (hint,)
    return " | ".join("None" if a is type(None) else _type_name(a) if typing.get_args(a)
                      else a.__name__ for a in args)


def describe_fields() -> list[tuple[str, str, str, str, str]]:
    """``(binding, type, default, on resume, meaning)`` of every gin-configurable field; ``on
    resume``: what resuming a checkpoint written under another value does (train/resume.py)."""
    rows = []
    for cls in GROUPS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            rows.append((f"{cls.__name__}.{f.name}", _type_name(hints[f.name]), repr(f.default),
                         f.metadata["resume"], f.metadata["help"]))
    return rows
