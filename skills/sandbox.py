"""Run distilled tool code (untrusted, usually written by an LLM) in a locked-down subprocess.

Two layers, each meant to stop the mistakes and prompt-injected tricks we expect from
model-written code, and each tested on its own (`run_tool(..., validate=False)` skips
the first so the tests can prove the second):

1. `validate_tool_code` reads the AST before anything runs: a top-level `def run(...)`,
   imports only from a small list of pure stdlib modules, no `eval`/`exec`/`open`/
   `getattr`/`__import__`..., no dunder or private attributes of other objects, no
   frame attributes, and top-level code limited to imports, defs and constants.
2. `run_tool` runs the code in a fresh `python -I -S` process (no site-packages, no
   inherited environment, cwd = a scratch dir) with a wall-clock timeout that kills the
   process group, and rlimits on CPU time, address space, file size, open files and
   core dumps. Before the tool code runs, an audit hook (`sys.addaudithook`) refuses:
   every `socket.*` event (so no network), `subprocess.Popen`, `os.system`/`exec`/
   `spawn`/`posix_spawn`/`fork`/`kill`, `ctypes.*`, `gc` object walks,
   imports of network/process/FFI/thread modules, writing, deleting or renaming anything
   outside the scratch dir, and reading anything outside the scratch dir and the
   standard library. The return value must be JSON; prints are captured and capped.

What this does NOT protect against -- it is not a security boundary:

* A determined attacker. Audit hooks are a CPython-level tripwire, not a kernel
  boundary: native code, an interpreter bug or a clever walk through Python objects
  can get around them. There is no seccomp filter, no chroot, no user or network
  namespace and no container. Run ratchet itself somewhere you would let such code run.
* The AST check is a deny-list of known escape routes; it cannot prove code safe
  (e.g. `"{0.__class__}".format(x)` still reads attributes, though only as text).
* Side channels and resource abuse within the limits (CPU for up to `timeout_s`,
  `memory_mb` of memory, files in the scratch dir up to the file-size limit).
* Modules already loaded at startup (`os`, `_thread`, ...) are not re-imported, so the
  import block cannot stop code that skipped validation from using them; only the
  audited actions above are refused. Such code could also write to its own stdout fd
  (an anonymous temp file, capped by RLIMIT_FSIZE) and so forge its own result.
* Reading the standard library's own files is allowed, because imports need it.
"""

from __future__ import annotations

import ast
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ratchet.errors import RatchetError

MAX_SOURCE_CHARS = 20_000
MAX_RESULT_BYTES = 1_000_000  # JSON-encoded return value
MAX_OUTPUT_CHARS = 64_000  # captured prints kept
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: files the tool writes in its scratch dir
MAX_OPEN_FILES = 64

ALLOWED_MODULES = frozenset(
    "math re json itertools functools collections statistics fractions decimal string operator "
    "heapq bisect datetime random typing dataclasses textwrap unicodedata".split()
)
FORBIDDEN_NAMES = frozenset(
    "eval exec compile open __import__ globals locals vars getattr setattr delattr input "
    "breakpoint memoryview help exit quit".split()
)
# Attributes that lead from an allowed module or object into the interpreter's internals
# (e.g. `dataclasses.sys`, `typing.sys`, `operator.attrgetter("__globals__")`, frames).
FORBIDDEN_ATTRS = frozenset(
    "sys os builtins inspect types gc importlib attrgetter methodcaller f_globals f_locals "
    "f_builtins f_back f_code gi_frame gi_code cr_frame cr_code ag_frame ag_code tb_frame".split()
)
SAFE_DUNDER_ATTRS = frozenset({"__init__", "__name__", "__doc__"})
# Imports the child refuses at runtime (a module that is not imported yet); the AST check
# already allows far less, but the allowed modules import many others internally.
BLOCKED_MODULES = (
    "socket _socket ssl _ssl subprocess _posixsubprocess ctypes _ctypes multiprocessing "
    "_multiprocessing asyncio http urllib.request ftplib smtplib poplib imaplib nntplib "
    "telnetlib xmlrpc socketserver pty fcntl mmap _posixshmem webbrowser threading".split()
)
_RESULT_MARK = b"\x00RATCHET-SANDBOX-RESULT\x00"  # precedes the reply, the last thing on stdout


class UnsafeCodeError(RatchetError):
    """Tool code that the static check refuses to run."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one tool call: `value` is the JSON-decoded return value when `ok`."""

    ok: bool
    value: Any
    error: str  # one line; empty when ok
    seconds: float
    output: str = ""  # what the tool printed, capped at MAX_OUTPUT_CHARS


def validate_tool_code(source: str, entry: str = "run") -> None:
    """Refuse code that reaches past pure computation; raises `UnsafeCodeError`."""
    if len(source) > MAX_SOURCE_CHARS:
        raise UnsafeCodeError(
            f"tool code is {len(source):,} characters; the limit is {MAX_SOURCE_CHARS:,}",
            "split it into smaller tools",
        )
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise UnsafeCodeError(f"tool code line {exc.lineno}: does not parse ({_one_line(exc.msg)})") from None
    except ValueError as exc:  # e.g. null bytes
        raise UnsafeCodeError(f"tool code does not parse ({_one_line(exc)})") from None
    for node in tree.body:
        if not _allowed_at_top_level(node):
            fix = "top-level code may only be imports, defs, classes, constants and a docstring"
            _refuse(
                node, f"top-level `{type(node).__name__}` statement", fix + "; move the work into a function"
            )
    if not any(isinstance(n, ast.FunctionDef) and n.name == entry for n in tree.body):
        raise UnsafeCodeError(f"tool code has no top-level `def {entry}(...)`", f"define `def {entry}(...)`")
    for node in ast.walk(tree):
        _check_node(node)


def _allowed_at_top_level(node: ast.stmt) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, ast.Expr):  # a docstring
        return isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        return node.value is None or _is_literal(node.value)
    return False


def _is_literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _check_node(node: ast.AST) -> None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
        for module in modules:
            if getattr(node, "level", 0) or module.partition(".")[0] not in ALLOWED_MODULES:
                _refuse(
                    node,
                    f"import of `{module}`",
                    "tools may import only " + ", ".join(sorted(ALLOWED_MODULES)),
                )
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                _check_attr(node, alias.name, owner=None)
    elif isinstance(node, ast.Name):
        if node.id in FORBIDDEN_NAMES or node.id.startswith("__"):
            _refuse(node, f"use of `{node.id}`", "tools may only compute on their arguments")
    elif isinstance(node, ast.Attribute):
        _check_attr(node, node.attr, owner=node.value)
    elif isinstance(node, ast.MatchClass):  # `case C(__class__=x)` reads attributes too
        for attr in node.kwd_attrs:
            _check_attr(node, attr, owner=None)


def _check_attr(node: ast.AST, attr: str, owner: ast.expr | None) -> None:
    if attr.startswith("__") and attr.endswith("__"):
        if attr not in SAFE_DUNDER_ATTRS:
            _refuse(
                node, f"access to dunder attribute `.{attr}`", "tools may not reach interpreter internals"
            )
    elif attr.startswith("_") and not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
        _refuse(
            node, f"access to private attribute `.{attr}`", "only `self` and `cls` may use private attributes"
        )
    elif attr in FORBIDDEN_ATTRS:
        _refuse(node, f"access to `.{attr}`", "tools may not reach interpreter internals")


def _refuse(node: ast.AST, what: str, fix: str) -> None:
    raise UnsafeCodeError(f"tool code line {getattr(node, 'lineno', '?')}: {what} is not allowed", fix)


def _one_line(value: object, limit: int = 300) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_tool(
    source: str,
    args: dict[str, Any],
    *,
    entry: str = "run",
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    scratch_dir: Path | None = None,
    validate: bool = True,
) -> SandboxResult:
    """Call `entry(**args)` from `source` in a fresh, limited subprocess.

    Failures of the tool (exceptions, timeouts, memory, forbidden actions, a non-JSON
    result) come back as `ok=False` with a one-line `error`; code that fails
    `validate_tool_code` raises `UnsafeCodeError` and is never run.
    """
    if validate:
        validate_tool_code(source, entry)
    cpu_s = math.ceil(timeout_s) + 1  # a backstop; the wall-clock timeout normally fires first
    limits = {  # (soft, hard); SIGXCPU at the soft CPU limit tells a timeout apart from a crash
        "RLIMIT_AS": (memory_mb * 2**20,) * 2,
        "RLIMIT_CPU": (cpu_s, cpu_s + 1),
        "RLIMIT_FSIZE": (MAX_FILE_BYTES,) * 2,
        "RLIMIT_NOFILE": (MAX_OPEN_FILES,) * 2,
        "RLIMIT_CORE": (0, 0),
    }
    with tempfile.TemporaryDirectory(prefix="ratchet-tool-", ignore_cleanup_errors=True) as tmp:
        scratch = Path(scratch_dir or tmp).resolve()
        scratch.mkdir(parents=True, exist_ok=True)
        job = {
            "source": source,
            "entry": entry,
            "args": args,
            "scratch": str(scratch),
            "limits": limits,
            "blocked": BLOCKED_MODULES,
            "mark": _RESULT_MARK.decode(),
            "max_result": MAX_RESULT_BYTES,
            "max_output": MAX_OUTPUT_CHARS,
        }
        # Anonymous files, not pipes: no deadlock, no path the tool could open, and
        # RLIMIT_FSIZE caps whatever the child writes to them.
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout:
            stdin.write(json.dumps(job).encode())
            stdin.seek(0)
            start = time.monotonic()
            # Limits are set by the child itself before the tool code runs, not in a
            # preexec_fn: preexec_fn can deadlock when the parent has threads (Prefect does).
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", _CHILD],
                stdin=stdin, stdout=stdout, stderr=subprocess.STDOUT, cwd=scratch,
                env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True,
            )  # fmt: skip
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            seconds = time.monotonic() - start
            stdout.seek(0)
            raw = stdout.read()
    return _decode(raw, proc.returncode, timed_out, timeout_s, memory_mb, seconds)


def _decode(
    raw: bytes, code: int, timed_out: bool, timeout_s: float, memory_mb: int, seconds: float
) -> SandboxResult:
    """Turn the child's marked reply, or how it died, into a result with a one-line error."""
    _, mark, tail = raw.rpartition(_RESULT_MARK)
    try:
        reply = json.loads(tail) if mark and not timed_out else {}
    except ValueError:  # cut short, e.g. by RLIMIT_FSIZE
        reply = {}
    output = reply.get("output", "")
    if reply.get("ok"):
        return SandboxResult(True, json.loads(reply["value"]), "", seconds, output)
    if timed_out or code == -signal.SIGXCPU:
        error = f"tool timed out after {float(timeout_s)} s"
    elif reply.get("memory") or (not reply and b"MemoryError" in raw):
        error = f"tool exceeded its memory limit ({memory_mb} MB)"
    elif reply:
        error = reply["error"]
    else:
        last = raw.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
        error = f"tool process died without a result (exit code {code}): {_one_line(last[0])}"
    return SandboxResult(False, None, error, seconds, output)


# The child: set limits, install the audit hook, run the tool, write one marked JSON reply.
_CHILD = r'''
import io, json, os, resource, sys

class Capped(io.TextIOBase):
    """Keeps the first `cap` characters the tool prints, so prints never reach the protocol."""
    def __init__(self, cap):
        self.cap, self.parts, self.size = cap, [], 0
    def writable(self):
        return True
    def write(self, text):
        if self.size < self.cap:
            self.parts.append(text[: self.cap - self.size])
            self.size += len(self.parts[-1])
        return len(text)
    def text(self):
        return "".join(self.parts) + ("\n[output truncated]" if self.size >= self.cap else "")

def install_guard(scratch, blocked):
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep
    read_roots = (scratch,) + tuple(realpath(p) for p in sys.path if p)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    denied = frozenset("""subprocess.Popen os.system os.exec os.spawn os.posix_spawn os.fork
        os.forkpty os.kill os.killpg os.chdir os.symlink os.startfile resource.setrlimit
        resource.prlimit signal.pthread_kill gc.get_objects
        gc.get_referrers gc.get_referents webbrowser.open""".split())
    # event: (positions of paths, positions of dir_fd arguments)
    path_events = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
                   "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)),
                   "os.truncate": ((0,), ()), "os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)),
                   "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ())}

    def inside(path, roots):
        if path is None:
            path = "."
        if type(path) not in (str, bytes):  # no PathLike tricks: __fspath__ could change its mind
            return False
        full = realpath(fsdecode(path))
        return any(full == root or full.startswith(root + sep) for root in roots)

    def guard(event, args):
        if event in denied or event.startswith(("socket.", "ctypes.", "syslog.")):
            raise PermissionError(f"sandbox blocked {event}")
        if event == "import":
            if any(args[0] == b or args[0].startswith(b + ".") for b in blocked):
                raise PermissionError(f"sandbox blocked import of {args[0]!r}")
        elif event == "open":
            path, mode, flags = args
            if isinstance(mode, str):
                writing = any(c in mode for c in "wax+")
            else:
                writing = bool((flags or 0) & write_flags)
            if type(path) is int and not writing:
                return  # reading an already-open descriptor
            if not inside(path, (scratch,) if writing else read_roots):
                what = f"file descriptor {path}" if type(path) is int else repr(path)
                verb = "writing" if writing else "reading"
                raise PermissionError(f"sandbox blocked {verb} {what}: outside the scratch dir")
        elif event in ("os.listdir", "os.scandir"):
            if type(args[0]) is not int and not inside(args[0], read_roots):
                raise PermissionError(f"sandbox blocked listing {args[0]!r}: outside the scratch dir")
        elif event in path_events:
            paths, dir_fds = path_events[event]
            if any(args[i] not in (None, -1) for i in dir_fds if i < len(args)) or not all(
                    type(args[i]) is int or inside(args[i], (scratch,)) for i in paths):
                raise PermissionError(f"sandbox blocked {event} outside the scratch dir")
        elif event == "object.__setattr__" and args[0] is guard:
            raise PermissionError("sandbox blocked changing its guard")

    sys.addaudithook(guard)

def describe(exc):
    text = " ".join(str(exc).split())
    text = (text[:297] + "...") if len(text) > 300 else text
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<tool>":
            line = tb.tb_lineno
        tb = tb.tb_next
    where = f" (line {line})" if line else ""
    return f"{type(exc).__name__}: {text}{where}" if text else f"{type(exc).__name__}{where}"

def call(job):
    try:
        namespace = {"__name__": "tool"}
        exec(compile(job["source"], "<tool>", "exec"), namespace)
        fn = namespace.get(job["entry"])
        if not callable(fn):
            return {"error": f"tool defines no function {job['entry']!r}"}
        value = fn(**job["args"])
    except MemoryError:
        return {"memory": True}  # returning drops the traceback, and with it the memory
    except BaseException as exc:
        return {"error": describe(exc)}
    try:
        encoded = json.dumps(value, allow_nan=False)
    except MemoryError:
        return {"memory": True}
    except Exception as exc:
        return {"error": f"tool returned a value that is not JSON-serializable ({describe(exc)})"}
    if len(encoded) > job["max_result"]:
        return {"error": f"tool returned {len(encoded):,} bytes of JSON; the limit is {job['max_result']:,}"}
    return {"ok": True, "value": encoded}

def main():
    job = json.loads(sys.stdin.buffer.read())
    for name, (soft, hard) in job["limits"].items():
        kind = getattr(resource, name)
        old_hard = resource.getrlimit(kind)[1]
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(kind, (soft, hard))
    os.chdir(job["scratch"])
    sys.stdout = sys.stderr = captured = Capped(job["max_output"])
    install_guard(job["scratch"], tuple(job["blocked"]))
    reply = call(job)
    reply["output"] = captured.text()
    data = b"\n" + job["mark"].encode() + json.dumps(reply).encode()
    while data:
        data = data[os.write(1, data):]
    os._exit(0)

main()
'''
