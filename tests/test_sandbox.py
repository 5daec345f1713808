"""The tool sandbox: the AST check refuses, and the runtime layer blocks on its own (validate=False)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from skills import sandbox
from skills.sandbox import MAX_OUTPUT_CHARS, SandboxResult, UnsafeCodeError, run_tool, validate_tool_code

MEMORY_ERROR = "tool exceeded its memory limit (256 MB)"


def failed(result: SandboxResult, *needles: str) -> str:
    """Assert the call failed with a one-line error containing every needle; return the error."""
    assert not result.ok and result.value is None, result
    assert result.error and "\n" not in result.error, result.error
    for needle in needles:
        assert needle in result.error
    return result.error


def test_working_tool_returns_its_value_and_output() -> None:
    source = '''"""Hypotenuse."""
import math

SCALE = 2

def run(a: float, b: float) -> dict:
    print("computing")
    return {"h": math.hypot(a, b) * SCALE, "items": [a, b]}
'''
    result = run_tool(source, {"a": 3, "b": 4})
    assert result == SandboxResult(True, {"h": 10.0, "items": [3, 4]}, "", result.seconds, "computing\n")
    assert 0 < result.seconds < 10


def test_realistic_tool_passes_both_layers() -> None:
    # Catches a validator or guard that is too strict for code we want: classes with private
    # state, super(), dataclasses and lazily imported stdlib internals (strptime, statistics).
    source = """
import collections, datetime, random, statistics
from dataclasses import dataclass

@dataclass
class Tally:
    name: str

class Counter(collections.Counter):
    def __init__(self, items):
        super().__init__(items)
        self._seen = len(items)

    def seen(self):
        return self._seen

def run(words: list) -> list:
    c = Counter(words)
    return [c.most_common(1)[0][0], c.seen(), Tally("t").name,
            datetime.datetime.strptime("2024-02-03", "%Y-%m-%d").day, statistics.median([3, 1, 2]),
            random.Random(0).randint(1, 1)]
"""
    assert run_tool(source, {"words": ["a", "b", "a"]}).value == ["a", 3, "t", 3, 2, 1]


def test_exception_in_tool_is_one_line_with_type_and_line() -> None:
    source = "def run(x):\n    y = x + 1\n    raise ValueError(f'bad input\\n{y}')\n"
    assert failed(run_tool(source, {"x": 1})) == "ValueError: bad input 2 (line 3)"
    failed(run_tool(source, {"wrong": 1}), "TypeError", "unexpected keyword argument 'wrong'")


def test_infinite_loop_is_stopped_by_the_timeout() -> None:
    result = run_tool("def run():\n    while True:\n        pass\n", {}, timeout_s=1.0)
    assert failed(result) == "tool timed out after 1.0 s"
    assert 1.0 <= result.seconds < 5.0


@pytest.mark.parametrize(
    "body",
    ["x = bytearray(10**10)", "chunks = []\n    while True:\n        chunks.append(bytearray(64 * 2**20))"],
    ids=["one-huge-allocation", "growing-list"],
)
def test_memory_bomb_is_stopped_by_the_memory_limit(body: str) -> None:
    result = run_tool(f"def run():\n    {body}\n", {}, timeout_s=20)
    assert failed(result) == MEMORY_ERROR


@pytest.fixture
def listener():
    """A local TCP server; afterwards, assert that nothing connected to it."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]
        server.settimeout(0.3)
        with pytest.raises(TimeoutError):
            server.accept()


CONNECT = "import socket\ndef run(port):\n    socket.create_connection(('127.0.0.1', port), timeout=2)\n"


def test_network_is_blocked_by_the_audit_hook_even_if_socket_is_importable(
    listener: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Empty the runtime import block-list: the socket module gets in, and the socket.* audit
    # events alone must stop the connection.
    monkeypatch.setattr(sandbox, "BLOCKED_MODULES", ())
    failed(
        run_tool(CONNECT, {"port": listener}, validate=False), "PermissionError", "sandbox blocked socket."
    )


@pytest.mark.parametrize(
    "source",
    [CONNECT, "def run(port):\n    __import__('socket').create_connection(('127.0.0.1', port))\n"],
    ids=["import", "__import__"],
)
def test_network_modules_cannot_be_imported_at_runtime(listener: int, source: str) -> None:
    failed(run_tool(source, {"port": listener}, validate=False), "sandbox blocked import of 'socket'")


@pytest.mark.parametrize("empty_blocklist", [False, True], ids=["import-blocked", "popen-blocked"])
def test_subprocess_is_blocked_at_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_blocklist: bool
) -> None:
    if empty_blocklist:
        monkeypatch.setattr(sandbox, "BLOCKED_MODULES", ())
    marker = tmp_path / "ran"
    source = "import subprocess\ndef run(path):\n    subprocess.run(['touch', path])\n"
    failed(run_tool(source, {"path": str(marker)}, validate=False), "PermissionError", "subprocess")
    assert not marker.exists()


@pytest.mark.parametrize(
    "body",
    [
        "open(path, 'w').write('x')",
        "import pathlib\n    pathlib.Path(path).write_text('x')",
        "import os\n    os.close(os.open(path, os.O_WRONLY | os.O_CREAT))",
        "import os\n    os.system('touch ' + path)",
    ],
    ids=["open", "pathlib", "os.open", "os.system"],
)
def test_writing_outside_the_scratch_dir_is_blocked(tmp_path: Path, body: str) -> None:
    target = tmp_path / "escape.txt"
    result = run_tool(f"def run(path):\n    {body}\n", {"path": str(target)}, validate=False)
    failed(result, "PermissionError: sandbox blocked")
    assert not target.exists()


def test_reading_outside_the_scratch_dir_is_blocked(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    result = run_tool("def run(path):\n    return open(path).read()\n", {"path": str(secret)}, validate=False)
    assert "hunter2" not in failed(result, "sandbox blocked reading")


def test_writing_inside_the_scratch_dir_works(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    source = "import os\ndef run():\n    open('out.txt', 'w').write('hi')\n    return os.listdir('.')\n"
    assert run_tool(source, {}, scratch_dir=scratch, validate=False).value == ["out.txt"]
    assert (scratch / "out.txt").read_text() == "hi"


def test_default_scratch_dir_is_fresh_and_removed_and_env_is_minimal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATCHET_TEST_SECRET", "s3cret")
    source = "import os\ndef run():\n    return [os.getcwd(), os.listdir('.'), dict(os.environ)]\n"
    cwd, listing, env = run_tool(source, {}, validate=False).value
    assert listing == [] and not Path(cwd).exists()
    assert "RATCHET_TEST_SECRET" not in env


@pytest.mark.parametrize(
    "source, needle",
    [
        ("import os\ndef run(): pass", "line 1: import of `os` is not allowed"),
        ("import subprocess\ndef run(): pass", "line 1: import of `subprocess` is not allowed"),
        ("from os import system\ndef run(): pass", "line 1: import of `os` is not allowed"),
        ("def run():\n    return __import__('os')", "line 2: use of `__import__` is not allowed"),
        ("def run():\n    return ().__class__.__bases__", "dunder attribute `.__bases__` is not allowed"),
        ("import random\ndef run():\n    return random._os", "line 3: access to private attribute `._os`"),
        ("import typing\ndef run():\n    return typing.sys", "line 3: access to `.sys` is not allowed"),
        ("from operator import attrgetter\ndef run(): pass", "access to `.attrgetter` is not allowed"),
        ("def run():\n    return eval('1')", "use of `eval` is not allowed"),
        ("def run(x):\n    match x:\n        case int(__class__=c): pass", "dunder attribute `.__class__`"),
        ("import re\nP = re.compile('x')\ndef run(): pass", "line 2: top-level `Assign` statement"),
        ("def helper(): pass", "no top-level `def run(...)`"),
        ("def run(:\n    pass", "line 1: does not parse"),
        ("def run(): pass\n" + "#" * 20_000, "the limit is 20,000"),
    ],
)
def test_validator_refuses_with_a_clear_one_line_message(source: str, needle: str) -> None:
    with pytest.raises(UnsafeCodeError) as info:
        validate_tool_code(source)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_run_tool_validates_by_default_and_never_runs_refused_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    source = f"def run():\n    open({str(marker)!r}, 'w')\n"
    with pytest.raises(UnsafeCodeError, match="use of `open`"):
        run_tool(source, {}, scratch_dir=tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("value", ["{1, 2}", "float('nan')", "object()"])
def test_non_json_return_value_is_a_clear_error(value: str) -> None:
    failed(
        run_tool(f"def run():\n    return {value}\n", {}),
        "tool returned a value that is not JSON-serializable",
    )


def test_printing_lots_of_text_does_not_break_the_result() -> None:
    # 10 MB of prints, including a forged result marker, must not reach the protocol.
    source = "def run(fake):\n    print(fake)\n    for _ in range(100_000):\n        print('x' * 100)\n"
    source += "    return 42\n"
    fake = sandbox._RESULT_MARK.decode() + '{"ok": true, "value": "666"}'
    result = run_tool(source, {"fake": fake}, timeout_s=20)
    assert result.ok and result.value == 42
    assert result.output.startswith(fake) and len(result.output) <= MAX_OUTPUT_CHARS + 100
