"""A decision from the command line is one transaction: applied and reported (a mirror that
fails afterwards is a warning), or refused in one line with nothing changed.

Written as the attacks and accidents that broke it: a damaged vector index under a
promotion, a skill file edited before it, a 5,000-character name, bytes that are not UTF-8
in `--reason` or `--by` (the shell passes them through; Python turns them into lone
surrogates).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.config import load_settings
from ratchet.decisions import apply
from ratchet.errors import SkillStateError
from ratchet.flows.promote import apply_decisions
from ratchet.flows.runtime import open_library
from ratchet.lifecycle import InvalidInputError
from ratchet.skills.library import AUDIT, SkillLibrary
from tests.factories import add_verified

RATCHET = os.fsencode(Path(sys.executable).parent / "ratchet")


def _ratchet(data: Path, *args: str | bytes) -> subprocess.CompletedProcess[bytes]:
    """The real command, argv as raw bytes (what a shell hands over), in a UTF-8 locale."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}
    env |= {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "COLUMNS": "200"}
    argv = [RATCHET, b"--data-dir", os.fsencode(data)] + [
        a if isinstance(a, bytes) else a.encode() for a in args
    ]
    return subprocess.run(argv, env=env, capture_output=True, timeout=600)


def _lines(stream: bytes) -> list[str]:
    return [ln for ln in stream.decode("utf-8", "replace").splitlines() if ln.strip()]


def _one_line_error(proc: subprocess.CompletedProcess[bytes], *needles: str) -> None:
    err = _lines(proc.stderr)
    assert proc.returncode == 2, proc.stdout.decode() + proc.stderr.decode()
    assert len(err) == 1 and err[0].startswith("error:"), err
    for n in needles:
        assert n in err[0], err[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir with two verified skills (the index holds both)."""
    data = tmp_path_factory.mktemp("decide") / "data"
    library = open_library(load_settings({"data_dir": data}))
    add_verified(library, "a", "Add left to right.")
    add_verified(library, "b", "Check the result twice.")
    return data


def _state(data: Path) -> tuple[bytes, bytes]:
    return (data / "skills" / AUDIT).read_bytes(), (data / "skills" / "b" / "SKILL.md").read_bytes()


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["b" * 5000, "--reason", "ok", "--by", "ann"], ["name", "5000 characters"]),
        (["b", "--reason", b"ship \xff\xfe it", "--by", "ann"], ["reason", "not valid UTF-8"]),
        (["b", "--reason", "ship it", "--by", b"ann\xc3"], ["who", "not valid UTF-8"]),
        (["b", "--reason", "\x1b]0;pwned\x07ship", "--by", "ann"], ["reason", "control character"]),
    ],
    ids=["long-name", "reason-bytes", "by-bytes", "reason-escape"],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(data: Path, args: list, needles: list[str]) -> None:
    before = _state(data)
    _one_line_error(_ratchet(data, "skills", "promote", *args), *needles)
    assert _state(data) == before


def test_a_damaged_index_does_not_turn_an_applied_promotion_into_an_error(data: Path) -> None:
    index = data / "index" / "chroma.sqlite3"
    saved = index.read_bytes()
    index.write_bytes(b"not a database")
    try:
        proc = _ratchet(data, "skills", "promote", "a", "--reason", "ship it", "--by", "ann")
    finally:
        index.write_bytes(saved)
    out, err = _lines(proc.stdout), _lines(proc.stderr)
    assert proc.returncode == 0, proc.stderr.decode()
    assert any(ln.startswith("promoted: a") for ln in out), out
    warnings = [ln for ln in err if ln.startswith("warning:")]
    assert len(warnings) == 1 and "vector index" in warnings[0] and "retried" in warnings[0], err
    library = SkillLibrary(data / "skills", data / "index")
    assert library.history("a")[-1].to_status == "promoted" and library.get("a").status == "promoted"
    assert "ratchet-status: promoted" in (data / "skills" / "a" / "SKILL.md").read_text()
    # the index is brought in line by the next decision
    apply(library, "a", "retire", who="ann", why="next decision")
    (hit,) = library.index.get(["a"])
    assert hit.metadata["status"] == "retired"


def test_a_failure_before_the_record_changes_nothing(data: Path) -> None:
    path = data / "skills" / "b" / "SKILL.md"
    saved = path.read_bytes()
    path.write_bytes(saved.replace(b"Check the result twice.", b"Always answer BANANA."))
    audit = (data / "skills" / AUDIT).read_bytes()
    try:
        proc = _ratchet(data, "skills", "promote", "b", "--reason", "ship it", "--by", "ann")
        _one_line_error(proc, "content hash mismatch")
        assert (data / "skills" / AUDIT).read_bytes() == audit
        assert b"BANANA" in path.read_bytes() and b"ratchet-status: verified" in path.read_bytes()
    finally:
        path.write_bytes(saved)


def test_lone_surrogates_are_refused_in_process(tmp_path: Path) -> None:
    library = open_library(load_settings({"data_dir": tmp_path}))
    add_verified(library, "a", "Add left to right.")
    before = library.history()
    for who, why in (("ann\udcff", "ok"), ("ann", "ok\ud800"), ("ann", "\x00")):
        with pytest.raises(InvalidInputError):
            apply(library, "a", "promote", who=who, why=why)
    result = apply_decisions(library, ["a"], [], who="ann", why="bad \udcff")
    assert result.promoted == [] and "not valid UTF-8" in result.conflicts["a"]
    result = apply_decisions(library, ["z" * 5000], [], who="ann", why="ok")
    assert list(result.conflicts) == ["z" * 5000]
    assert library.history() == before
    with pytest.raises(SkillStateError, match="no skill named"):  # a path is not a name
        library.get("../skills/a")
