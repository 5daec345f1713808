"""State files a killed process cannot tear: directories and text replaced by a rename,
append-only JSONL logs fsynced per record and read back strictly."""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ratchet.errors import StateFileError

M = TypeVar("M", bound=BaseModel)


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `target`; when the block succeeds it replaces
    `target` by a rename. On any error (or a kill) nothing half-written is left at `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and a rename (never a torn file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def append_line(path: Path, line: str) -> None:
    """Append one record and fsync it: once this returns, the record survives a power cut."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():  # a complete last record cut just before its newline must not glue onto this one
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(line.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path, model: type[M], what: str) -> list[M]:
    """Every record of an append-only log; a damaged line is one StateFileError that says how
    to recover. Nothing is skipped or rewritten: the log is the record of what happened."""
    return [record for _, record in read_jsonl_numbered(path, model, what)]


def read_jsonl_numbered(path: Path, model: type[M], what: str) -> list[tuple[int, M]]:
    """Like `read_jsonl`, each record with its line number (1-based), so a reader that finds
    a record wrong can name the line to fix."""
    if not path.exists():
        return []
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise StateFileError(f"cannot read {what} {path}: {exc.strerror}", "check its permissions") from None
    lines = raw.split(b"\n")
    torn_tail = bool(lines and lines[-1])  # a complete log ends with a newline
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((number, model.model_validate_json(line)))
        except (ValidationError, ValueError):
            if torn_tail and number == len(lines):
                quoted = shlex.quote(str(path))  # the command must give a shell back this very path
                raise StateFileError(
                    f"{what} {path} ends in a torn line {number} (a write was killed half-way)",
                    f"that change was never completed, so it did not happen: delete the line "
                    f"(sed -i '{number}d' {quoted}) and run again",
                ) from None
            raise StateFileError(
                f"{what} {path} line {number} is damaged (not a valid record)",
                "restore the file from a backup; ratchet will not guess what it said",
            ) from None
    return records


@contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `lock` (created if missing) for the block: one writer of a
    lifecycle at a time, across threads and processes."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
