"""State files a killed process cannot tear: directories and text replaced by a rename,
append-only JSONL logs fsynced per record and read back strictly."""

from __future__ import annotations

import fcntl
import os
import secrets
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

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
    """Write `text` to `path` through a temporary file and a rename (never a torn file). The
    temporary file has a fresh random name and is created with O_CREAT|O_EXCL|O_NOFOLLOW, so a
    link planted beside `path` (at a name guessed or left from an old version) is never followed
    and nothing outside the directory is written; its mode is what the umask gives."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode()  # before anything is created: text that cannot be written leaves nothing
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(16):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:  # taken (by chance, or planted): another name
            continue
    else:
        raise StateFileError(f"cannot make a temporary file beside {path}", "check that directory")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_regular_file(path: Path, what: str) -> bool:
    """Does the state file `path` exist? A directory, a FIFO or a broken link by its name is
    one StateFileError now (the pre-flight), not a failure when a stage writes it."""
    if not os.path.lexists(path):
        return False
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "a broken link" if path.is_symlink() else "not a file"
        raise StateFileError(
            f"{what} {path} is not a regular file (it is {kind})",
            "move it away (ratchet then starts that file afresh) or restore the file from a backup",
        )
    return True


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Is `value` (parsed JSON) nested more than `limit` lists or objects deep? Iterative, so a
    deep value cannot overflow the stack that measures it; a reader refuses such a value at load
    rather than meet a RecursionError in the first encoder or copy that walks it later."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > limit:
                return True
            stack += [(child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)]
    return False


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
    if not check_regular_file(path, what):
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
