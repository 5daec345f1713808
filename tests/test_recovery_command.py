"""The command an audit-log error gives to recover runs on the very file it names.

A data dir path may hold spaces, quotes, `$(...)`, backticks and `;`: the `sed -i` line in the
message must give a shell back that exact path (`shlex.quote`), never split it or run what it
holds. Both messages that print a command: a torn last line (`ratchet.files`) and a line
ratchet did not write (`ratchet.lifecycle.check_history`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from ratchet.errors import StateFileError
from ratchet.lifecycle import Record, read_log
from tests.test_cli import RATCHET, assert_one_line_error

ODD = ["my data's dir", 'a "quoted" dir', "$(touch pwned) `touch pwned2`; echo x", 'it\'s a "mix" (1)']
FILED = {"name": "a", "from_status": None, "to_status": "candidate", "who": "d", "why": "w"}
FORGED = {"name": "x", "from_status": "verified", "to_status": "promoted", "who": "d", "why": "w"}


def _torn(audit: Path) -> None:
    audit.parent.mkdir(parents=True, exist_ok=True)
    audit.write_text(json.dumps(FILED) + "\n" + '{"name": "b", "from_status": null, "to_st')


def _forged(audit: Path) -> None:
    audit.parent.mkdir(parents=True, exist_ok=True)
    audit.write_text(json.dumps(FILED) + "\n" + json.dumps(FORGED) + "\n")


def _command(message: str) -> str:
    """The `sed -i ...` command inside the message's parentheses."""
    start = message.index("(sed -i ") + 1
    tail = ") and run again"
    end = message.rindex(tail) if tail in message else message.rindex(")")
    return message[start:end]


@pytest.mark.parametrize("odd", ODD)
@pytest.mark.parametrize("spoil", [_torn, _forged], ids=["torn last line", "a line ratchet did not write"])
def test_the_recovery_command_gives_the_shell_back_the_exact_path(tmp_path: Path, odd: str, spoil) -> None:  # type: ignore[no-untyped-def]
    audit = tmp_path / odd / ".ratchet" / "skills" / "audit.jsonl"
    spoil(audit)
    with pytest.raises(StateFileError) as refused:
        read_log(audit.parent, "skill audit log")
    command = _command(str(refused.value))
    assert shlex.split(command) == ["sed", "-i", "2d", str(audit)]
    # run as a person pastes it: the line goes, nothing the path holds runs
    subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True, capture_output=True)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    assert [r.name for r in read_log(audit.parent, "skill audit log")] == ["a"]
    assert isinstance(read_log(audit.parent, "x")[0], Record)


@pytest.mark.parametrize("odd", ODD[:2])
def test_the_cli_prints_a_command_that_works_under_an_odd_data_dir(tmp_path: Path, odd: str) -> None:
    data = tmp_path / odd / ".ratchet"
    audit = data / "skills" / "audit.jsonl"
    _torn(audit)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}
    args = [RATCHET, "--data-dir", str(data), "skills", "list"]
    proc = subprocess.run(args, cwd=tmp_path, env=env | {"COLUMNS": "200"}, capture_output=True, text=True)
    assert_one_line_error(proc, "ends in a torn line 2")
    assert shlex.split(_command(proc.stderr.strip())) == ["sed", "-i", "2d", str(audit)]
