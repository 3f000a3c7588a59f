"""The inputs of ``python -m boost_jax.data.prepare``: which files are read, and their documents.

Inputs are ``.txt``-like files (one document per file) and ``.jsonl``/``.json`` files (one
document per line, field ``text_field``), optionally ``.gz``/``.xz``/``.bz2``-compressed, or
directories of them (searched recursively, files in sorted order), or a Hugging Face dataset
directory saved with ``save_to_disk`` (its ``.arrow`` files, column ``text_field``; needs
pyarrow). Everything is read as a stream.

A ``pattern`` (a glob on file *names*, e.g. ``c4-train.*.json.gz``) selects among the files
found in directories: the others are ignored, never read, and counted (:class:`Inputs`). A file
named explicitly is always read (naming it is selecting it). A pattern that matches no file
of a directory, or given without any directory to search, is a :class:`PrepareError`.
"""

from __future__ import annotations

import bz2
import dataclasses
import fnmatch
import gzip
import io
import json
import lzma
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

_OPENERS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}


class PrepareError(ValueError):
    """A user-caused failure (bad input, tokenizer spec or output): its message is one line
    that says what is wrong and what to do. The command prints it instead of a traceback."""


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The files an input list names: ``files`` to read, in order, and ``ignored``, the files
    found in its directories that do not match the pattern."""

    files: list[Path]
    ignored: list[Path]


def _saved_dataset(p: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face ``save_to_disk`` directory, in order (None when
    ``p`` is not one)."""
    if not ((p / "state.json").is_file() and (p / "dataset_info.json").is_file()):
        return None
    try:
        state = json.loads((p / "state.json").read_text())
        return [p / f["filename"] for f in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as err:
        raise PrepareError(f"{p / 'state.json'}: not a Hugging Face save_to_disk state file "
                           f"({err!r})") from err


def list_inputs(paths: Sequence[str | Path], pattern: str | None = None, *,
                input_flag: str = "--input", pattern_flag: str = "--pattern") -> Inputs:
    """The input files named by ``paths``: directories expanded (recursively, sorted), a
    Hugging Face ``save_to_disk`` directory to its Arrow files; with ``pattern``, only the
    files of directories whose name matches it (see the module docstring). ``input_flag`` and
    ``pattern_flag`` name the flags in error messages."""
    what = input_flag.lstrip("-").replace("_", " ")
    files, ignored, directories = [], [], 0
    for p in map(Path, paths):
        if p.is_dir():
            directories += 1
            found = _saved_dataset(p)
            found = sorted(f for f in p.rglob("*") if f.is_file()) if found is None else found
            if pattern is not None:
                matched = [f for f in found if fnmatch.fnmatchcase(f.name, pattern)]
                if found and not matched:
                    example = found[0].relative_to(p)
                    raise PrepareError(f"{pattern_flag}={pattern!r} matches none of the "
                                       f"{len(found)} files under {p} (e.g. {example}); "
                                       f"check {pattern_flag}")
                keep = set(matched)
                ignored += [f for f in found if f not in keep]
                found = matched
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise PrepareError(f"{what} {p} does not exist; check {input_flag}")
    if not files:
        raise PrepareError(f"no {what} files in {', '.join(map(str, paths))}; check {input_flag}")
    if pattern is not None and not directories:
        raise PrepareError(f"{pattern_flag}={pattern!r} selects among the files of {input_flag} "
                           f"directories, and {input_flag} names none (a file named explicitly "
                           f"is always read); drop {pattern_flag}")
    return Inputs(files, ignored)


class _Counted(io.RawIOBase):
    """A binary file that tells ``on_read`` the size of every read: the progress bar counts
    the bytes of the input files as they are (compressed or not)."""

    def __init__(self, raw, on_read: Callable[[int], None]):
        self.raw, self.on_read = raw, on_read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int | None:
        n = self.raw.readinto(buffer)
        self.on_read(n or 0)
        return n


def read_documents(paths: Sequence[str | Path], text_field: str = "text",
                   on_read: Callable[[int], None] | None = None,
                   pattern: str | None = None) -> Iterator[str]:
    """Yield the documents of every input file (:func:`list_inputs` of ``paths`` and
    ``pattern``), streaming (see the module docstring).

    ``on_read(n)``: told the number of bytes of every read from the files (the progress bar).
    A missing, unreadable or malformed input raises :class:`PrepareError` naming it.
    """
    count = on_read or (lambda n: None)
    for path in list_inputs(paths, pattern).files:
        try:
            if path.suffix == ".arrow":
                yield from _arrow_documents(path, text_field)
                count(path.stat().st_size)
            else:
                yield from _file_documents(path, text_field, count)
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as err:
            raise PrepareError(f"{path}: cannot read it ({err})") from err


#: what an undecodable byte becomes when read with ``errors="surrogateescape"``: one lone
#: surrogate U+DC80-U+DCFF per byte, which no UTF-8 text decodes to
_UNDECODED = re.compile("[\udc80-\udcff]")


def _file_documents(path: Path, text_field: str, count: Callable[[int], None]) -> Iterator[str]:
    """A text file's one document, or a JSONL file's ``text_field`` of every line. The text
    must be UTF-8: a file with bytes that are not is a :class:`PrepareError` that counts them
    (the whole file read) and says where the first is -- never text silently replaced."""
    suffixes = path.suffixes
    opener = _OPENERS.get(suffixes[-1] if suffixes else "")
    base = suffixes[-2] if opener and len(suffixes) > 1 else path.suffix
    with open(path, "rb", buffering=0) as raw:
        binary = io.BufferedReader(_Counted(raw, count), 64 * 1024)
        with io.TextIOWrapper(opener(binary) if opener else binary, encoding="utf-8",
                              errors="surrogateescape") as f:
            if base in (".jsonl", ".json"):
                for n, line in enumerate(f, 1):
                    if _UNDECODED.search(line):
                        _not_utf8(path, f"line {n}", line, f)
                    if line.strip():
                        yield _jsonl_text(path, n, line, text_field)
            else:
                text = f.read()
                if _UNDECODED.search(text):
                    _not_utf8(path, "the text", text, ())
                yield text


def _not_utf8(path: Path, where: str, text: str, rest: Iterator[str]) -> None:
    """Raise the :class:`PrepareError` of a file that is not UTF-8: ``text`` holds the first
    undecodable bytes (at ``where``), ``rest`` is the file's text after it (counted too)."""
    first = _UNDECODED.search(text)
    byte = ord(first.group()) - 0xDC00
    bad = len(_UNDECODED.findall(text)) + sum(len(_UNDECODED.findall(t)) for t in rest)
    raise PrepareError(f"{path}: {bad} byte(s) that are not UTF-8 (the first, 0x{byte:02x}, in "
                       f"{where}); prepare reads UTF-8 text: convert the file first, e.g. "
                       f"iconv -f latin1 -t utf-8")


def _jsonl_text(path: Path, n: int, line: str, text_field: str) -> str:
    """The ``text_field`` of line ``n`` of a JSONL file."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PrepareError(f"{path}:{n}: not valid JSON ({err.msg}); a .jsonl or .json file "
                           "must hold one JSON object per line") from None
    if not isinstance(record, dict):
        raise PrepareError(f"{path}:{n}: {line.strip()[:40]!r} is not a JSON object; a .jsonl "
                           "or .json file must hold one JSON object per line")
    if text_field not in record:
        raise PrepareError(f"{path}:{n}: no field {text_field!r} (fields: "
                           f"{', '.join(record) or 'none'}); name the text's with "
                           "--text_field=<field>")
    text = record[text_field]
    if not isinstance(text, str):
        raise PrepareError(f"{path}:{n}: field {text_field!r} holds {json.dumps(text)[:40]}, "
                           "not a string; name the text's field with --text_field")
    return text


def _arrow_documents(path: Path, text_field: str) -> Iterator[str]:
    """The ``text_field`` column of an Arrow IPC stream file (what ``datasets``'
    ``save_to_disk`` writes), a record batch at a time; null values are empty documents."""
    try:
        import pyarrow as pa
    except ImportError:
        raise PrepareError(f"{path}: reading Arrow files (a Hugging Face dataset saved with "
                           "save_to_disk) needs pyarrow: pip install pyarrow") from None
    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            if text_field not in reader.schema.names:
                raise PrepareError(f"{path}: no column {text_field!r} (columns: "
                                   f"{', '.join(reader.schema.names)}); name the text's with "
                                   "--text_field=<column>")
            kind = reader.schema.field(text_field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise PrepareError(f"{path}: column {text_field!r} holds {kind}, not strings; "
                                   "name the text's column with --text_field")
            for batch in reader:
                yield from (t for t in batch.column(text_field).to_pylist() if t is not None)
    except pa.ArrowException as err:
        raise PrepareError(f"{path}: not a readable Arrow stream file ({err})") from err


def chunks(docs: Iterator[str], chunk_bytes: int) -> Iterator[list[str]]:
    """Group non-empty documents into lists of about ``chunk_bytes`` characters."""
    chunk, size = [], 0
    for doc in docs:
        if not doc.strip():
            continue
        chunk.append(doc)
        size += len(doc)
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
