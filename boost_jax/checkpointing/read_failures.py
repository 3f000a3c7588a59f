"""What a failed checkpoint read raised, and what kind of failure it is (:func:`classify`):
damage only when the bytes are proven bad, so that a checkpoint is quarantined only then
(checkpointing/checkpointer.py); and the root cause orbax and TensorStore wrap
(:func:`root_cause`)."""

from __future__ import annotations

import enum
import json
import os
import re

from boost_jax.errors import ConfigError


class ResumeMismatch(ConfigError):
    """The checkpoints of a workdir do not fit this run's configuration or state (one line)."""



class Failure(enum.IntEnum):
    """How a read failed, worst last (every process acts on the worst any of them saw)."""

    NONE = 0
    TRANSIENT = 1  # an I/O error: retried, then reported
    MISSING = 2  # a file not found: retried (listing lag), then damage
    UNKNOWN = 3  # not recognised: retried, then reported, never quarantined
    DAMAGED = 4  # a checksum or decode failure: quarantined at once


# TensorStore status codes (the first word of its errors' messages)
_TRANSIENT_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "RESOURCE_EXHAUSTED",
                    "CANCELLED")
# what TensorStore and orbax say of bytes that do not decode (seen on damaged checkpoints)
_DECODE_SIGNS = ("Invalid JSON", "ZSTD_decompress", "checksum", "Digest mismatch",
                 "Error decoding")


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and its causes, outermost first."""
    chain = []
    while err is not None and all(err is not e for e in chain):
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def root_cause(err: BaseException) -> BaseException:
    """The innermost of ``err``'s causes (``__cause__``, else ``__context__``; ``err`` itself
    when it has none): what orbax and TensorStore wrap, e.g. TensorStore's "DATA_LOSS: ...
    Digest mismatch" under orbax's "Encountered error while reading ..."."""
    return _chain(err)[-1]


def one_line(err: BaseException, limit: int = 300) -> str:
    """The root cause of ``err`` (:func:`root_cause`) on one line."""
    root = root_cause(err)
    text = str(root).split("See full TensorStore details")[0]  # then a page of JSON spec
    return f"{type(root).__name__}: {' '.join(text.split())[:limit]}"


def classify(err: BaseException) -> Failure:
    """What kind of failure reading a checkpoint raised ``err`` is: damage only when the bytes
    are proven bad (a decode or checksum failure); see :class:`Failure`."""
    chain = _chain(err)
    if any(isinstance(e, UnicodeDecodeError | json.JSONDecodeError) for e in chain):
        return Failure.DAMAGED
    if any(isinstance(e, FileNotFoundError) for e in chain):
        return Failure.MISSING
    if any(isinstance(e, OSError) for e in chain):
        return Failure.TRANSIENT
    text = str(chain[-1])
    code = text.split(":", 1)[0].strip()
    if code == "DATA_LOSS":
        return Failure.DAMAGED
    if code == "NOT_FOUND":
        return Failure.MISSING
    if code in _TRANSIENT_CODES or "OS error" in text:
        return Failure.TRANSIENT
    if any(sign in text for sign in _DECODE_SIGNS):
        return Failure.DAMAGED
    return Failure.UNKNOWN


#: how TensorStore names the file and the OS error in a status message, e.g. (tensorstore
#: 0.1.x, a full disk) ``RESOURCE_EXHAUSTED: Error writing local file "/ckpt/8/.../c/0": ...
#: No space left on device [os_error_code='28']``
_TS_OS_ERROR = re.compile(r"\[os_error_code='(\d+)'\]")
_TS_FILE = re.compile(r'local file "([^"]+)"')


def os_error(err: BaseException) -> OSError | None:
    """The OSError behind ``err`` (itself, or along its causes), if any -- or the one a
    TensorStore status error reports in its text (TensorStore raises ValueError, its OS error
    code in the message: a full disk is ``RESOURCE_EXHAUSTED ... [os_error_code='28']``)."""
    chain = _chain(err)
    found = next((e for e in chain if isinstance(e, OSError)), None)
    if found is not None:
        return found
    for e in chain:
        if code := _TS_OS_ERROR.search(str(e)):
            where = _TS_FILE.search(str(e))
            number = int(code.group(1))
            return OSError(number, os.strerror(number), where.group(1) if where else None)
    return None
