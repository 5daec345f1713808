"""The tool sandbox: the AST check refuses, the runtime guards block on their own (validate=False),
the interpreter allow-list refuses module walks before the run and again at run time, and no code
runs at all without the OS isolation. tests/test_sandbox_escape.py attacks the OS layer."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ratchet.skills import sandbox
from ratchet.skills.sandbox import (
    MAX_OUTPUT_CHARS,
    SandboxResult,
    SandboxUnavailableError,
    ToolCallError,
    UnsafeCodeError,
    run_tool,
    validate_tool_code,
)

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
    # state, super(), annotations and lazily imported stdlib internals (strptime, statistics).
    # (`dataclasses` is off the list: tests/test_sandbox_allowlist.py.)
    source = """
import collections, datetime, random, statistics
from typing import Optional

class Tally:
    name: str

    def __init__(self, name: str, note: Optional["Tally"] = None) -> None:
        self.name = name

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


def test_default_scratch_dir_is_fresh_and_leaves_nothing_on_the_host_and_env_is_minimal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_TEST_SECRET", "s3cret")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a host-side scratch dir would go
    source = "import os\ndef run():\n    found = os.listdir('.')\n    open('left.txt', 'w').write('x')\n"
    source += "    return [os.getcwd(), found, dict(os.environ)]\n"
    for _ in range(2):  # the second call does not see the first one's file
        cwd, listing, env = run_tool(source, {}, validate=False).value
        assert cwd == "/scratch" and listing == []
    assert "RATCHET_TEST_SECRET" not in env
    assert list(tmp_path.iterdir()) == []  # a tmpfs inside the sandbox, gone with it


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
        # Formatting that walks attributes and items, or evaluates strings as code:
        ("import string\ndef run():\n    return string.Formatter()", "line 3: access to `.Formatter`"),
        ("from string import Formatter\ndef run(): pass", "access to `.Formatter` is not allowed"),
        ("from string import *\ndef run(): pass", "line 1: `from string import *` is not allowed"),
        ("def run(f):\n    return f.get_field('0.real', [1], {})", "access to `.get_field`"),
        ("def run(f):\n    return f.vformat('{0}', [1], {})", "access to `.vformat`"),
        ("def run(x):\n    return '{a}'.format_map({'a': x})", "access to `.format_map`"),
        (
            "def run(x):\n    return '{0.__class__}'.format(x)",
            "format field `{0.__class__}` (attribute or item",
        ),
        ("def run(x):\n    return '{x.real}'.format(x=x)", "format field `{x.real}`"),
        ("def run(x):\n    return '{0[0]}'.format(x)", "format field `{0[0]}`"),
        ("def run(x):\n    return '{0:{1.real}}'.format(x, 1)", "format field `{1.real}`"),
        ("def run(t, x):\n    return t.format(x)", "line 2: `.format` on a computed string"),
        ("def run(x):\n    return str.format('{0.real}', x)", "`.format` on a computed string"),
        ("def run(x):\n    return ('{0' + '.real}').format(x)", "`.format` on a computed string"),
        ("def run(x):\n    return '{'.format(x)", "a malformed format string"),
        ("import typing\ndef run(f):\n    return typing.get_type_hints(f)", "access to `.get_type_hints`"),
        ("import functools\n@functools.singledispatch\ndef run(x): pass", "access to `.singledispatch`"),
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


def test_plain_format_templates_pass_and_work() -> None:
    source = (
        "def run(a, b):\n    return ['{} {}'.format(a, b), '{0}-{1!r:>4}'.format(a, b), '{x}'.format(x=a),"
    )
    source += " f'{a.real}']\n"
    assert run_tool(source, {"a": 1, "b": 2}).value == ["1 2", "1-   2", "1", "1"]


def test_macro_templates_written_by_the_toolsmith_pass() -> None:
    from ratchet.agents.toolsmith import macro_source
    from ratchet.skills.mining import ActionTemplate, Pattern

    pattern = Pattern(
        "suite:family",
        (
            ActionTemplate("act", {"action": "move {a}"}),
            ActionTemplate("act", {"action": "take {b} from {a}"}),
        ),
        ("a", "b"),
        ({"a": "north", "b": "coin"},),
        2,
        2,
        ("t1",),
    )
    code = macro_source(pattern).code
    validate_tool_code(code)
    assert run_tool(code, {"a": "north", "b": "coin"}).value[1]["args"] == {"action": "take coin from north"}


# Reaches `os` through Formatter.get_field without a dunder attribute in the code; on the sandbox
# before bubblewrap it passed validation, and its dir_fd write into the stdlib got past the audit
# hook. tests/test_sandbox_escape.py runs it without the AST check against the OS layer.
FORMATTER_WALK = """
import string

def run(name):
    fmt = string.Formatter()
    for cls in fmt.get_field("0.__class__.__base__.__subclasses__", [()], {})[0]():
        try:
            namespace = fmt.get_field("0.__init__.__globals__", [cls], {})[0]
        except AttributeError:
            continue
        if "__builtins__" in namespace:
            os = namespace["__builtins__"]["__import__"]("os")
            fd = os.open(fmt.get_field("0.__file__", [os], {})[0].rsplit("/", 1)[0], os.O_RDONLY)
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT, dir_fd=fd))
            return "escaped"
"""


def test_formatter_walk_is_refused_before_it_runs() -> None:
    with pytest.raises(UnsafeCodeError, match="line 5: access to `.Formatter` is not allowed"):
        run_tool(FORMATTER_WALK, {"name": "sitecustomize.py"})


@pytest.mark.parametrize(
    "body, needle",
    [
        # the dir_fd trick: a descriptor of the stdlib dir makes a relative write look like scratch
        (
            "fd = os.open(os.path.dirname(os.__file__), os.O_RDONLY)\n"
            "    os.open('sitecustomize.py', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
            "sandbox blocked opening directory",
        ),
        ("return os.stat('/usr/bin').st_size", "sandbox blocked os.stat of '/usr/bin'"),
        ("os.mkfifo('/tmp/fifo')", "sandbox blocked os.mkfifo of '/tmp/fifo'"),
        ("os.mkfifo('fifo', dir_fd=os.open('.', os.O_RDONLY))", "sandbox blocked os.mkfifo of 'fifo'"),
    ],
    ids=["dir_fd", "stat", "mkfifo", "mkfifo-dir_fd"],
)
def test_inner_guards_refuse_what_cpython_does_not_audit(body: str, needle: str) -> None:
    failed(run_tool(f"import os\ndef run():\n    {body}\n", {}, validate=False), "PermissionError", needle)


def test_a_tool_killed_by_a_signal_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_INNER_GUARDS", False)  # the audit hook would refuse os.kill
    source = "import os, signal\ndef run():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    failed(run_tool(source, {}, validate=False), "tool process died without a result (exit code -9)")


def test_inner_guards_still_let_the_tool_stat_its_scratch_dir() -> None:
    source = "import os\ndef run():\n    open('f', 'w').write('abc')\n    return os.stat('f').st_size\n"
    assert run_tool(source, {}, validate=False).value == 3


# The review's attack on the audit hook, from code already past the allow-list (validate=False):
# the path check was a closure reachable from the os.stat wrapper (`os.stat.__closure__`), and
# replacing its `realpath` cell (which CPython does not audit) let the tool read /usr/bin/env,
# write /tmp/x and list /usr. Each variant tries another way to rewire the checker, then the
# three operations; the checker must still refuse all three.
GUARD_ATTACK = '''
import builtins, os, posixpath, sys

def functions_in_reach(root):
    """Every Python function reachable from `root` through closures, bound state and defaults."""
    seen, todo, found = set(), [root], []
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if type(value).__name__ == "function":
            found.append(value)
            todo += [c.cell_contents for c in value.__closure__ or () if c.cell_contents is not None]
            todo += list(value.__defaults__ or ()) + list((value.__kwdefaults__ or {}).values())
        elif type(value).__name__ == "method":
            todo += [value.__func__, value.__self__]
        elif type(value) in (tuple, list, frozenset):
            todo += list(value)
    return found

def everything_inside(*args, **kwargs):
    return "/scratch/x"

def closure_walk():
    for fn in functions_in_reach(os.stat):
        for cell in fn.__closure__ or ():
            contents = cell.cell_contents
            if callable(contents) and getattr(contents, "__name__", "") in ("realpath", "fsdecode"):
                cell.cell_contents = everything_inside
            elif type(contents) is list:
                contents.append(True)  # a re-entrancy flag that skips the checks

def code_swap():
    refused = []
    for fn in functions_in_reach(os.stat):
        try:  # a function with free variables takes only code with as many: those fail
            fn.__code__ = (lambda *args, **kwargs: True).__code__
        except (ValueError, PermissionError) as exc:
            refused.append(str(exc))
    if refused:
        raise PermissionError("; ".join(refused))

def stdlib_patch():
    os.path.realpath = posixpath.realpath = everything_inside
    os.fsdecode = lambda path: "/scratch/x"
    os.stat_result.st_mode = property(lambda self: 0o100644)  # no directory is a directory
    os.getcwd = lambda: "/scratch"
    os.readlink = lambda *args, **kwargs: "/scratch"
    builtins.any = lambda *args: True
    builtins.type = lambda *args: str

def child_globals():
    main = vars(sys.modules["__main__"])
    for name, value in list(main.items()):
        if callable(value) and not isinstance(value, type):
            main[name] = lambda *args, **kwargs: True

def trace_locals():
    def tracer(frame, event, arg):
        for name in ("full", "path"):
            if name in frame.f_locals and frame.f_code.co_filename == "<string>":
                frame.f_locals[name] = "/scratch/x"
        return tracer
    sys.settrace(tracer)

def attempt(fn):
    try:
        fn()
    except Exception as exc:  # not type(exc): stdlib_patch replaced the builtin `type`
        return f"{exc.__class__.__name__}: {exc}"
    return "ok"

def run(variant):
    rewired = attempt(globals()[variant])
    return {
        "rewired": rewired,
        "read": attempt(lambda: open("/usr/bin/env", "rb").read(4)),
        "write": attempt(lambda: open("/tmp/x", "w").write("x")),
        "list": attempt(lambda: os.listdir("/usr")),
        "stat": attempt(lambda: os.stat("/usr/bin")),
    }
'''


@pytest.mark.parametrize(
    "variant", ["closure_walk", "code_swap", "stdlib_patch", "child_globals", "trace_locals"]
)
def test_tool_code_cannot_switch_off_the_audit_hooks_path_checks(variant: str) -> None:
    outcome = run_tool(GUARD_ATTACK, {"variant": variant}, validate=False).value
    assert outcome is not None
    for what in ("read", "write", "list"):
        assert outcome[what].startswith("PermissionError: sandbox blocked"), (what, outcome)
    if variant == "code_swap":  # CPython audits it, and the hook refuses it for its own functions
        assert outcome["rewired"].startswith("PermissionError: sandbox blocked changing its guard"), outcome


def test_putting_the_unwrapped_os_stat_back_is_a_known_miss() -> None:
    """Code past the allow-list can reach the real os.stat (the wrapper's bound state, or a fresh
    `posix` module from the import system) and stat what the OS layer shows; the hook holds."""
    source = GUARD_ATTACK + "\ndef unwrap():\n    os.stat = os.stat.__self__[0]\n"
    outcome = run_tool(source, {"variant": "unwrap"}, validate=False).value
    assert outcome["rewired"] == "ok" and outcome["stat"] == "ok", outcome
    assert outcome["read"].startswith("PermissionError: sandbox blocked reading"), outcome


def test_the_guards_functions_hold_nothing_tool_code_could_rewire() -> None:
    """No globals, builtins or closure cells (all of which tool code past the allow-list can
    change), and no nested functions: only what their bound state tuple holds."""
    import dis
    import types

    from ratchet.skills import sandbox_child

    for fn in sandbox_child.GUARD_FUNCTIONS:
        code = fn.__code__
        assert code.co_freevars == code.co_cellvars == (), fn
        assert not [k for k in code.co_consts if isinstance(k, types.CodeType)], fn
        names = ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF")
        looked_up = [i.argval for i in dis.get_instructions(fn) if i.opname in names]
        assert looked_up == [], (fn.__name__, looked_up)


# ------------------------------------------------------------------ library calls: one clear error


def _free_frames() -> int:
    """How many more nested Python calls the stack has room for, here."""

    def probe(depth: int) -> int:
        try:
            return probe(depth + 1)
        except RecursionError:
            return depth

    return probe(0)


def _with_room(room: int, call: Callable[[], SandboxResult]) -> SandboxResult:
    """`call()` from a frame with about `room` frames left below the recursion limit (measured:
    pytest's C calls use up more of the limit than its frames show)."""

    def down(levels: int) -> SandboxResult:
        if levels > 0:
            return down(levels - 1)
        return down(0) if _free_frames() > room else call()

    return down(max(_free_frames() - room - 20, 0))


@pytest.mark.parametrize("room", [1, 3, 8])
def test_run_tool_from_a_deep_stack_returns_its_result(room: int) -> None:
    """The old run_tool raised RecursionError from halfway through the call with 8 frames left."""
    result = _with_room(room, lambda: run_tool("def run():\n    return 1\n", {}))
    assert result.ok and result.value == 1, result


SIMPLE = "def run():\n    return 1\n"


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 1e300, -1.0, 0, True, "5"])
def test_a_timeout_run_tool_cannot_enforce_is_one_clear_error(timeout_s: object) -> None:
    with pytest.raises(ToolCallError, match="tool timeout must be a number of seconds above 0") as info:
        run_tool(SIMPLE, {}, timeout_s=timeout_s)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


@pytest.mark.parametrize("memory_mb", [0, -1, 2**60, 1.5, True])
def test_a_memory_limit_run_tool_cannot_enforce_is_one_clear_error(memory_mb: object) -> None:
    with pytest.raises(ToolCallError, match="tool memory limit must be a whole number of MB"):
        run_tool(SIMPLE, {}, memory_mb=memory_mb)  # type: ignore[arg-type]


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _cycle() -> dict:
    value: dict = {}
    value["self"] = value
    return value


@pytest.mark.parametrize(
    "args",
    [{"x": {1, 2}}, {"x": object()}, {"x": _nested(100_000)}, _cycle()],
    ids=["set", "object", "deep", "cycle"],
)
def test_arguments_that_are_not_json_are_one_clear_error(args: dict) -> None:
    with pytest.raises(ToolCallError, match=r"tool arguments are not JSON \(") as info:
        run_tool("def run(**kwargs):\n    return 1\n", args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("body", ["not " * 4_000 + "1", "-" * 19_000 + "1"], ids=["not", "minus"])
def test_code_nested_too_deeply_to_parse_is_refused_in_one_line(body: str) -> None:
    """CPython's parser raises RecursionError or MemoryError on these: not a refusal, before."""
    with pytest.raises(UnsafeCodeError, match="tool code is nested too deeply to check"):
        run_tool(f"def run():\n    return {body}\n", {})


# ------------------------------------------------------------------ no isolation, no run

NOT_FOUND = (
    "tool sandbox unavailable: bubblewrap (bwrap) not found. "
    "install it: apt-get install bubblewrap (./install.sh does)"
)


@pytest.fixture
def unprobed(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Forget the cached probe; monkeypatch puts the real one back afterwards."""
    monkeypatch.setattr(sandbox, "_ISOLATION", None)
    return monkeypatch


def _fake_bwrap(monkeypatch: pytest.MonkeyPatch, path: Path | None) -> None:
    monkeypatch.setattr(sandbox.shutil, "which", lambda *a, **k: None if path is None else str(path))


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_without_bwrap_no_code_runs(tmp_path: Path, unprobed: pytest.MonkeyPatch) -> None:
    _fake_bwrap(unprobed, None)
    marker = tmp_path / "ran"
    source = f"def run():\n    open({str(marker)!r}, 'w')\n"
    for _ in range(2):  # the probe's verdict is cached, and raised afresh each time
        with pytest.raises(SandboxUnavailableError) as info:
            run_tool(source, {}, validate=False, scratch_dir=tmp_path / "scratch")
        assert str(info.value) == NOT_FOUND
    assert not marker.exists() and not (tmp_path / "scratch").exists()


@pytest.mark.parametrize(
    "body, why",
    [
        ("echo 'bwrap: No permissions to create new namespace' >&2\nexit 1\n", "(bwrap: No permissions"),
        # A "bwrap" that runs the command without isolating it must be caught too.
        ('while [ "$1" != -- ]; do shift; done\nshift\nexec "$@"\n', f"uid and cwd '{os.getuid()} /', not"),
        ("echo 'bwrap: Unknown option --disable-userns' >&2\nexit 1\n", "install bubblewrap 0.8 or newer"),
    ],
    ids=["no-namespaces", "not-isolating", "too-old"],
)
def test_a_bwrap_that_cannot_isolate_is_refused(
    tmp_path: Path, unprobed: pytest.MonkeyPatch, body: str, why: str
) -> None:
    _fake_bwrap(unprobed, _script(tmp_path / "bwrap", body))
    marker = tmp_path / "ran"
    with pytest.raises(SandboxUnavailableError, match="bubblewrap cannot set up its namespaces here") as info:
        run_tool(f"def run():\n    open({str(marker)!r}, 'w')\n", {}, validate=False)
    assert why in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


def test_toolsmith_refuses_the_candidate_when_the_sandbox_is_unavailable(
    unprobed: pytest.MonkeyPatch,
) -> None:
    from ratchet.agents.toolsmith import MacroJob, build_toolsmith
    from ratchet.skills.mining import ActionTemplate, Pattern
    from ratchet.skills.screen import Screen

    _fake_bwrap(unprobed, None)
    examples = ({"a": "north"}, {"a": "south"})
    pattern = Pattern("s:f", (ActionTemplate("act", {"action": "move {a}"}),), ("a",), examples, 2, 2, ("t",))
    out = build_toolsmith(None).invoke({"job": MacroJob("m", pattern), "screen": Screen()})
    assert out["tool"] is None and out["problems"] == [NOT_FOUND]


def test_toolbox_call_fails_with_the_one_line_reason(unprobed: pytest.MonkeyPatch) -> None:
    from ratchet.skills.toolbox import SandboxTool

    _fake_bwrap(unprobed, None)
    tool = SandboxTool(
        name="t", description="d", parameters={"type": "object"}, code="def run():\n    return 1\n"
    )
    result = asyncio.run(tool.run({}))
    assert [c.text for c in result.content] == [NOT_FOUND]


def test_a_tool_runs_when_the_process_holds_over_a_thousand_descriptors() -> None:
    """A long run (the loop, a test session) holds many files and sockets; waiting on the
    sandboxed child must not depend on how high its descriptor's number is."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip("the hard descriptor limit is below 1100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    try:
        assert run_tool("def run(a):\n    return a + 1\n", {"a": 1}).value == 2
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_tool_code_is_parsed_one_thread_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rollouts validate tool code in parallel threads, and CPython 3.11's AST builder is not
    safe to run in two at once (a spurious SystemError failed a real tool call)."""
    import ast
    import threading
    import time

    real, inside, most = ast.parse, [0], [0]
    count = threading.Lock()

    def slow_parse(source: str, *args: object, **kwargs: object) -> ast.Module:
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)  # wide enough for every other thread to try to enter
        try:
            return real(source)
        finally:
            with count:
                inside[0] -= 1

    monkeypatch.setattr(sandbox.ast, "parse", slow_parse)
    threads = [
        threading.Thread(target=validate_tool_code, args=("def run(x):\n    return x\n",)) for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1


# ------------------------------------------------------------------ the interpreter allow-list

# The review's attack: `re` imports `enum`, which imports `builtins` as `bltns`. On the sandbox
# before the allow-list this passed validation, ran `eval` with every layer on, and forged its own
# result by writing a reply to the real stdout and exiting before the child could.
FORGE = """
import re

def run(mark):
    ev = re.enum.bltns.eval
    ev("__import__('os').write(1, m)", {"m": mark.encode() + b'{"ok": true, "value": "\\\\"forged\\\\""}'})
    ev("__import__('os')._exit(0)")
"""


def test_module_walk_to_eval_is_refused_before_it_runs() -> None:
    with pytest.raises(UnsafeCodeError, match=r"line 5: access to `re\.enum` is not allowed"):
        run_tool(FORGE, {"mark": sandbox._RESULT_MARK.decode()})


@pytest.mark.parametrize(
    "source, needle",
    [
        ("import re\ndef run():\n    return re.enum.bltns.eval('1')", "line 3: access to `re.enum`"),
        ("import json\ndef run():\n    return json.codecs.open('f', 'w')", "line 3: access to `json.codecs`"),
        ("from json import codecs\ndef run(): pass", "line 1: `from json import codecs` is not allowed"),
        ("from json import decoder\ndef run(): pass", "`from json import decoder` is not allowed"),
        ("import statistics\ndef run():\n    return statistics.random", "access to `statistics.random`"),
        ("import typing\ndef run():\n    return typing.functools", "access to `typing.functools`"),
        ("import textwrap as t\ndef run():\n    return t.re", "access to `textwrap.re`"),
        # a module as a value: an alias, a container, an argument, a default
        ("import re\ndef run():\n    m = re\n    return m.enum", "line 3: `re` used other than as `re.name`"),
        ("import re\ndef run():\n    return [re][0].enum", "`re` used other than as `re.name`"),
        ("import re\ndef run(f):\n    return f(re)", "`re` used other than as `re.name`"),
        ("import re\ndef run(m=re):\n    return m.enum", "`re` used other than as `re.name`"),
        ("import re\ndef run():\n    import json as re", "line 3: `re` names two modules"),
        ("class C:\n    import re\ndef run():\n    return C.re.enum", "line 2: `import` in a class body"),
        ("import collections.abc\ndef run(): pass", "line 1: `import collections.abc` is not allowed"),
        ("from collections import abc\ndef run(): pass", "`from collections import abc` is not allowed"),
        ("from . import re\ndef run(): pass", "line 1: relative import"),
        # APIs that read attributes named by a string: update_wrapper's `assigned=("__builtins__",)`
        ("import functools\ndef run():\n    return functools.update_wrapper", "`functools.update_wrapper`"),
        ("from functools import wraps\ndef run(): pass", "`from functools import wraps` is not allowed"),
        ("import operator\ndef run():\n    return operator.attrgetter('x')", "access to `.attrgetter`"),
    ],
)
def test_module_attribute_walks_are_refused(source: str, needle: str) -> None:
    with pytest.raises(UnsafeCodeError) as info:
        validate_tool_code(source)
    message = str(info.value)
    assert needle in message and "\n" not in message, message


UPDATE_WRAPPER = """
import functools

class Box:
    seen = {}

    def __setattr__(self, name, value):
        self.seen[name] = value

def run():
    functools.update_wrapper(Box(), run, assigned=("__builtins__",), updated=())
    return Box.seen["__builtins__"]["eval"]("6 * 7")
"""


def test_update_wrapper_cannot_copy_builtins_out_of_a_function() -> None:
    with pytest.raises(UnsafeCodeError, match="line 11: access to `functools.update_wrapper`"):
        run_tool(UPDATE_WRAPPER, {})


@pytest.fixture
def runtime_view_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static check off, its runtime twin on: run_tool(validate=True) still gives the tool
    only views of its modules and builtins without eval, open, getattr..."""
    monkeypatch.setattr(sandbox, "validate_tool_code", lambda source, entry="run": None)


@pytest.mark.parametrize(
    "source, needle",
    [
        (FORGE, "AttributeError: module 're' has no attribute 'enum' in the sandbox (not on its allow-list)"),
        ("import json\ndef run():\n    m = json\n    return m.codecs.open", "has no attribute 'codecs'"),
        ("def run():\n    from json import decoder", "ImportError: cannot import name 'decoder'"),
        ("def run():\n    import os", "ImportError: tool code may not import 'os'"),
        ("def run():\n    import collections.abc", "tool code may not import 'collections.abc'"),
        ("def run():\n    return __import__('socket')", "tool code may not import 'socket'"),
        ("def run():\n    return eval('1')", "NameError: name 'eval' is not defined"),
        ("def run():\n    return open('f', 'w')", "NameError: name 'open' is not defined"),
        ("def run():\n    return getattr(1, 'real')", "NameError: name 'getattr' is not defined"),
        ("import functools\ndef run():\n    return functools.wraps", "has no attribute 'wraps'"),
    ],
)
def test_the_runtime_view_refuses_on_its_own(runtime_view_only: None, source: str, needle: str) -> None:
    failed(run_tool(source, {"mark": sandbox._RESULT_MARK.decode()} if "mark" in source else {}), needle)


def test_the_runtime_view_still_runs_real_tools(runtime_view_only: None) -> None:
    source = "import re\nfrom collections.abc import Iterable\ndef run(t):\n"
    source += "    return [re.findall(r'\\d+', t), isinstance([], Iterable), re.IGNORECASE.value]\n"
    assert run_tool(source, {"t": "a1b22"}).value == [["1", "22"], True, 2]


def _reachable(root: object, depth: int) -> Iterator[tuple[str, object]]:
    """Everything reachable from `root` through public (non-underscore) attributes."""
    seen: set[int] = set()
    todo = [("", root, 0)]
    while todo:
        path, value, level = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield path, value
        if level == depth:
            continue
        for name in dir(value):
            if name.startswith("_"):
                continue
            try:
                found = getattr(value, name)
            except Exception:
                continue
            todo.append((f"{path}.{name}", found, level + 1))


def test_allowed_names_lead_to_no_module_and_no_dangerous_builtin() -> None:
    """Walk three public attributes deep from every allow-listed name: no module object, nothing
    that runs or opens text (eval, open, os.system, codecs.open...), nothing that walks attribute
    paths named by a string (attrgetter, update_wrapper...)."""
    import builtins
    import codecs
    import dataclasses
    import functools
    import importlib
    import io
    import operator
    import string
    import types
    import typing

    dangerous = {id(getattr(builtins, n)) for n in sandbox.FORBIDDEN_NAMES if hasattr(builtins, n)}
    dangerous |= {id(operator.attrgetter), id(operator.methodcaller), id(functools.update_wrapper)}
    dangerous |= {id(functools.wraps), id(functools.singledispatch), id(codecs.open), id(io.open)}
    dangerous |= {id(string.Formatter), id(typing.get_type_hints), id(typing.ForwardRef)}
    dangerous |= {id(dataclasses.make_dataclass)}
    # anything defined by a module that reaches the OS or the interpreter's internals
    homes = {"os", "posix", "sys", "io", "_io", "codecs", "_codecs", "inspect", "socket", "_socket"}
    homes |= {"importlib", "subprocess", "ctypes", "gc", "types"}
    problems = []
    for module_name, names in sandbox.ALLOWED_IMPORTS.items():
        module = importlib.import_module(module_name)
        for name in sorted(names):
            for path, value in _reachable(getattr(module, name), depth=3):
                home = getattr(value, "__module__", None) if callable(value) else None
                if (
                    isinstance(value, types.ModuleType)
                    or id(value) in dangerous
                    or (isinstance(home, str) and home.partition(".")[0] in homes)
                ):
                    problems.append(f"{module_name}.{name}{path}: {value!r}"[:120])
    assert problems == []


def test_the_allow_list_names_only_what_each_module_has() -> None:
    import importlib
    import types

    assert sandbox.ALLOWED_MODULES == frozenset(sandbox.ALLOWED_IMPORTS)
    for module_name, names in sandbox.ALLOWED_IMPORTS.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert not name.startswith("_") and hasattr(module, name), f"{module_name}.{name}"
            assert not isinstance(getattr(module, name), types.ModuleType), f"{module_name}.{name}"
            assert name not in sandbox.FORBIDDEN_ATTRS, f"{module_name}.{name}"


def test_tools_using_every_allowed_module_still_pass_both_layers() -> None:
    source = """
import bisect, decimal, fractions, functools, heapq, itertools, json, math, operator, re
import string, textwrap, unicodedata
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from typing import Any, Dict, List, Optional

Point = None

@functools.lru_cache(maxsize=None)
def fib(n: int) -> int:
    return n if n < 2 else fib(n - 1) + fib(n - 2)

def run(text: str, items: Optional[List[int]] = None) -> Dict[str, Any]:
    items = items or [5, 1, 4]
    heap = list(items)
    heapq.heapify(heap)
    pair = (1, 2)
    return {
        "words": re.findall(r"[a-z]+", text.lower()),
        "sum": functools.reduce(operator.add, items),
        "first": heapq.heappop(heap),
        "where": bisect.bisect_left(sorted(items), 4),
        "pairs": len(list(itertools.combinations(items, 2))),
        "frac": str(fractions.Fraction(1, 3) + fractions.Fraction(1, 6)),
        "dec": str(decimal.Decimal("1.10") + decimal.Decimal("2.20")),
        "hyp": math.hypot(3, 4),
        "json": json.loads(json.dumps({"k": [1]})),
        "letters": string.ascii_lowercase[:3],
        "dedent": textwrap.dedent("  x"),
        "norm": unicodedata.normalize("NFC", "e\\u0301"),
        "count": Counter(text).most_common(1)[0][1],
        "dd": defaultdict(int)["x"],
        "dq": deque([1, 2], maxlen=1)[0],
        "pair": pair[1],
        "fib": fib(20),
        "iterable": isinstance(items, Iterable),
        "key": sorted([{"n": 2}, {"n": 1}], key=operator.itemgetter("n"))[0]["n"],
    }
"""
    value = run_tool(source, {"text": "Hello hello world"}).value
    assert value["words"] == ["hello", "hello", "world"] and value["fib"] == 6765
    assert value["frac"] == "1/2" and value["dec"] == "3.30" and value["norm"] == "\u00e9"
    assert value["pair"] == 2 and value["key"] == 1 and value["iterable"] is True


# ------------------------------------------------------------------ the child program


def test_the_child_program_is_a_stdlib_only_module() -> None:
    """It runs inside the sandbox with only the standard library on sys.path."""
    import ast

    path = Path(sandbox.__file__).with_name("sandbox_child.py")
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").partition(".")[0])
    assert imported and imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
