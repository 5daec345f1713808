"""Run distilled tool code (untrusted, usually written by an LLM) in an isolated subprocess.

The layers, outermost first. The first is the wall; the others are tripwires that turn the
mistakes and prompt-injected tricks we expect into clear errors. The tests switch the inner
ones off (`validate=False`, `_INNER_GUARDS`, `_SECCOMP`) to prove the outer ones hold alone.

1. OS isolation (bubblewrap). The child runs in its own user, mount, pid, network, IPC, UTS
   and cgroup namespaces as uid/gid 65534, with no capabilities, `no_new_privs` and no way to
   create further user namespaces, in its own session, killed with its parent. It sees only
   /usr (with the /bin, /lib... links) and the Python installation, read-only; a read-only
   minimal /dev; a fresh size-capped tmpfs at /tmp; and the scratch dir at /scratch, its
   cwd: a fresh size-capped tmpfs, or the caller's `scratch_dir` bound read-write, the only
   host path it can write. No /proc, /sys, /etc, home, project or data dirs; an empty
   environment but PATH and LANG; a network namespace holding only its own loopback. The pid
   namespace dies with the call, so the timeout kills every process the tool started. If
   bubblewrap is missing or cannot create the namespaces, `run_tool` raises
   `SandboxUnavailableError` and runs nothing: there is no unisolated fallback.
2. A seccomp filter (x86_64) refuses with EPERM: fork/clone (no new processes or threads),
   sockets, mknod/mkfifo, and mount, namespace, ptrace, bpf, keyring, io_uring, module and
   similar kernel interfaces (`_DENIED_SYSCALLS_X86_64`).
3. Resource limits, set by the child before the tool runs: a wall-clock timeout, and
   rlimits on CPU time, address space, file size, open files and core dumps.
4. A CPython audit hook (`sys.addaudithook`) refuses network, process and FFI events,
   imports of such modules, writing, deleting or renaming outside the scratch dir, reading
   outside the scratch dir and the standard library, and opening directories elsewhere
   (whose descriptors would make `dir_fd=` calls look relative to the scratch dir); wrappers
   refuse `os.stat`/`lstat` and `os.mkfifo`/`mknod` outside those dirs, which CPython does
   not audit.
5. `validate_tool_code` reads the AST before anything runs: a top-level `def run(...)`,
   imports only from a small list of pure stdlib modules, no `eval`/`exec`/`open`/
   `getattr`/`__import__`..., no dunder or private attributes of other objects, no frame
   attributes, nothing that evaluates text as attribute paths or code
   (`string.Formatter`, `.format_map`, `.format` on computed templates or with `{0.attr}` /
   `{0[key]}` fields, `typing.get_type_hints`, `functools.singledispatch`), and top-level
   code limited to imports, defs and constants. The return value must be JSON; prints are
   captured and capped.

What this does NOT cover:

* Kernel bugs, and CPU or memory side channels: namespaces, mounts and seccomp are
  enforced by the kernel the tool shares with the host, and a kernel exploit escapes them.
* Reading what is mounted: the tool can read the read-only /usr and the Python
  installation (including its site-packages), anything the caller puts in `scratch_dir`,
  and of course its own arguments. Don't pass secrets to a tool.
* Resource use within the limits: CPU for up to `timeout_s`, `memory_mb` of address space
  per process plus the tmpfs caps, and, in a caller-supplied `scratch_dir`, disk space
  bounded only by the timeout and the file-size limit. Without seccomp (not x86_64) a
  tool can also start processes until the timeout ends them.
* Inside the user namespace the tool is uid 65534, but outside it is the user who runs
  ratchet (an unprivileged bubblewrap can only map its caller's uid): files it creates in
  a caller-supplied scratch dir belong to that user, mode bits included (it can leave a
  set-uid file there: keep such a dir private and never run what is in it), and any host
  path that were mounted writable by mistake would be writable as that user.
* Its own output: the tool owns its stdout, so it can print anything and forge its own
  result. Treat the value as untrusted data, not as instructions.
* The inner layers alone: the AST check is a deny-list and the audit hook a CPython-level
  tripwire; native code, an interpreter bug or a clever object walk gets past them, which is
  why the OS isolation exists.

Cost per call (2 shared cores, medians of 40, measured side by side): bubblewrap adds ~4 ms
to the interpreter's start (`python -c pass`: 8.7 -> 12.4 ms) and the seccomp filter ~1 ms,
but a whole call of a trivial tool went from 33.2 to 25.8 ms, because the wait now wakes on
a pidfd instead of polling and the scratch dir is a tmpfs instead of a host temp dir.
"""

from __future__ import annotations

import ast
import errno
import json
import math
import os
import platform
import select
import shutil
import signal
import string
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ratchet.errors import RatchetError

MAX_SOURCE_CHARS = 20_000
MAX_RESULT_BYTES = 1_000_000  # JSON-encoded return value
MAX_OUTPUT_CHARS = 64_000  # captured prints kept
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: files the tool writes in its scratch dir
MAX_OPEN_FILES = 64
MAX_SCRATCH_BYTES = 64 * 2**20  # the default scratch dir: a tmpfs of this size
MAX_TMP_BYTES = 16 * 2**20  # /tmp inside the sandbox: a tmpfs of this size
SCRATCH = "/scratch"  # where the scratch dir is, inside the sandbox
SANDBOX_UID = 65534  # `nobody`, inside the sandbox's user namespace

# Private knobs for the tests, which switch layers off to prove the others hold on their own.
_INNER_GUARDS = True  # the audit hook, the import block-list and the os.stat/mkfifo wrappers
_SECCOMP = True  # the syscall filter (x86_64 only)

ALLOWED_MODULES = frozenset(
    "math re json itertools functools collections statistics fractions decimal string operator "
    "heapq bisect datetime random typing dataclasses textwrap unicodedata".split()
)
FORBIDDEN_NAMES = frozenset(
    "eval exec compile open __import__ globals locals vars getattr setattr delattr input "
    "breakpoint memoryview help exit quit".split()
)
# Attributes that lead from an allowed module or object into the interpreter's internals
# (e.g. `dataclasses.sys`, `typing.sys`, `operator.attrgetter("__globals__")`, frames), or
# that evaluate text as code or attribute paths: `string.Formatter().get_field("0.__class__...")`
# returns live objects, and `typing.get_type_hints` / `functools.singledispatch` `eval` string
# annotations.
FORBIDDEN_ATTRS = frozenset(
    "sys os builtins inspect types gc importlib attrgetter methodcaller f_globals f_locals "
    "f_builtins f_back f_code gi_frame gi_code cr_frame cr_code ag_frame ag_code tb_frame "
    "Formatter get_field vformat format_map get_type_hints ForwardRef singledispatch "
    "singledispatchmethod".split()
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

# Syscalls the seccomp filter refuses with EPERM (x86_64 numbers, asm/unistd_64.h): new
# processes and threads, sockets, device nodes and FIFOs, and kernel interfaces a pure
# computation never needs (mounts, namespaces, ptrace, bpf, keyrings, io_uring, modules...).
_DENIED_SYSCALLS_X86_64 = {
    "clone": 56, "clone3": 435, "fork": 57, "vfork": 58, "socket": 41, "socketpair": 53,
    "mknod": 133, "mknodat": 259, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "unshare": 272, "setns": 308, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "pidfd_getfd": 438, "kcmp": 312, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "open_by_handle_at": 304, "name_to_handle_at": 303,
    "acct": 163, "swapon": 167, "swapoff": 168, "reboot": 169, "syslog": 103, "quotactl": 179,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "fanotify_init": 300, "iopl": 172, "ioperm": 173, "uselib": 134,
    "personality": 135,
}  # fmt: skip


class SandboxUnavailableError(RatchetError):
    """The OS-level isolation cannot be set up here, so no tool code is run at all."""


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


# CPython 3.11 keeps the AST converter's recursion counter in interpreter-wide state: two
# threads building ASTs at once can corrupt it (python/cpython#106905). Seen here as
# "SystemError: AST constructor recursion depth mismatch" when rollouts validated tool code in
# parallel, failing a legitimate tool call. One parse at a time; a parse takes microseconds.
_parse_lock = threading.Lock()


def validate_tool_code(source: str, entry: str = "run") -> None:
    """Refuse code that reaches past pure computation; raises `UnsafeCodeError`."""
    if len(source) > MAX_SOURCE_CHARS:
        raise UnsafeCodeError(
            f"tool code is {len(source):,} characters; the limit is {MAX_SOURCE_CHARS:,}",
            "split it into smaller tools",
        )
    try:
        with _parse_lock:
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
                if alias.name == "*":
                    _refuse(node, f"`from {module} import *`", "import the names the tool uses")
                _check_attr(node, alias.name, owner=None)
    elif isinstance(node, ast.Name):
        if node.id in FORBIDDEN_NAMES or node.id.startswith("__"):
            _refuse(node, f"use of `{node.id}`", "tools may only compute on their arguments")
    elif isinstance(node, ast.Attribute):
        _check_attr(node, node.attr, owner=node.value)
        if node.attr == "format":
            _check_format(node)
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


def _check_format(node: ast.Attribute) -> None:
    """`str.format` looks up attributes and items named in its template (`"{0.__class__}"`),
    so only literal templates whose fields are plain (`{}`, `{0}`, `{name}`) may use it."""
    template = node.value
    if not (isinstance(template, ast.Constant) and isinstance(template.value, str)):
        _refuse(node, "`.format` on a computed string", "use `.format` on a string literal, or an f-string")
    try:
        fields = _format_fields(template.value)
    except ValueError:
        _refuse(node, "a malformed format string", "fix its `{}` fields")
    for field in fields:
        if "." in field or "[" in field:
            _refuse(
                node,
                f"format field `{{{field}}}` (attribute or item lookup)",
                "format plain values, e.g. `'{}'.format(x.attr)`, or use an f-string",
            )


def _format_fields(template: str) -> list[str]:
    """Every replacement field name in a format string, including those nested in format specs."""
    fields = []
    for _, name, spec, _ in string.Formatter().parse(template):
        if name is not None:
            fields.append(name)
        if spec:
            fields += _format_fields(spec)
    return fields


def _refuse(node: ast.AST, what: str, fix: str) -> NoReturn:
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
    """Call `entry(**args)` from `source` in a fresh, isolated, limited subprocess.

    Failures of the tool (exceptions, timeouts, memory, forbidden actions, a non-JSON
    result) come back as `ok=False` with a one-line `error`; code that fails
    `validate_tool_code` raises `UnsafeCodeError` and is never run, and so does any code
    when the OS-level isolation is unavailable (`SandboxUnavailableError`).

    The scratch dir is `/scratch` inside: a fresh tmpfs of `MAX_SCRATCH_BYTES` that
    vanishes with the call, or `scratch_dir` from the host, bound read-write. Nothing here
    reads the scratch dir afterwards.
    """
    if validate:
        validate_tool_code(source, entry)
    isolation = _isolation()
    cpu_s = math.ceil(timeout_s) + 1  # a backstop; the wall-clock timeout normally fires first
    limits = {  # (soft, hard); SIGXCPU at the soft CPU limit tells a timeout apart from a crash
        "RLIMIT_AS": (memory_mb * 2**20,) * 2,
        "RLIMIT_CPU": (cpu_s, cpu_s + 1),
        "RLIMIT_FSIZE": (MAX_FILE_BYTES,) * 2,
        "RLIMIT_NOFILE": (MAX_OPEN_FILES,) * 2,
        "RLIMIT_CORE": (0, 0),
    }
    host_scratch = None
    if scratch_dir is not None:
        host_scratch = Path(scratch_dir).resolve()
        host_scratch.mkdir(parents=True, exist_ok=True)
    job = {
        "source": source,
        "entry": entry,
        "args": args,
        "scratch": SCRATCH,
        "limits": limits,
        "guards": _INNER_GUARDS,
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
        proc = _spawn(isolation, host_scratch, stdin, stdout)
        try:
            timed_out = _wait(proc, timeout_s)
        finally:
            if proc.poll() is None:
                # bwrap leads its own process group; its death takes down the sandbox's pid 1
                # (--die-with-parent) and with it every process in the pid namespace.
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        seconds = time.monotonic() - start
        stdout.seek(0)
        raw = stdout.read()
    return _decode(raw, proc.returncode, timed_out, timeout_s, memory_mb, seconds)


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the child to exit; True if the timeout came first. A pidfd wakes us as soon as
    it exits: `Popen.wait(timeout)` polls with growing sleeps, ~20 ms more on a short call."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return True
        return False
    try:  # poll, not select: select refuses descriptors past 1023, which a long run reaches
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        ready = poller.poll(timeout_s * 1000)
    finally:
        os.close(pidfd)
    if ready:
        proc.wait()
    return not ready


def _spawn(isolation: _Isolation, host_scratch: Path | None, stdin: Any, stdout: Any) -> subprocess.Popen:
    """Start the child under bubblewrap; the limits are set by the child itself, not in a
    preexec_fn, which can deadlock when the parent has threads (Prefect does)."""
    fds: list[int] = []
    try:
        argv = _command(isolation, host_scratch, fds, _SECCOMP)
        argv += ["-I", "-S", "-B", "-X", "utf8", "-c", _CHILD]
        return subprocess.Popen(
            argv, stdin=stdin, stdout=stdout, stderr=subprocess.STDOUT, cwd="/",
            env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True, pass_fds=fds,
        )  # fmt: skip
    finally:
        for fd in fds:
            os.close(fd)


def _command(isolation: _Isolation, host_scratch: Path | None, fds: list[int], seccomp: bool) -> list[str]:
    """bwrap's command line up to the interpreter; appends the descriptors to pass to `fds`."""
    argv = list(isolation.argv)
    if host_scratch is None:
        argv += ["--size", str(MAX_SCRATCH_BYTES), "--tmpfs", SCRATCH]
    else:
        argv += ["--bind", str(host_scratch), SCRATCH]
    argv += ["--chdir", SCRATCH, "--remount-ro", "/"]
    program = _seccomp_program() if seccomp else None
    if program is not None:
        fds.append(os.memfd_create("ratchet-seccomp"))
        os.write(fds[-1], program)
        os.lseek(fds[-1], 0, os.SEEK_SET)
        argv += ["--seccomp", str(fds[-1])]
    return [*argv, "--", isolation.python]


# ------------------------------------------------------------------ the OS-level isolation


@dataclass(frozen=True)
class _Isolation:
    argv: tuple[str, ...]  # bwrap and the options every call shares
    python: str  # the real interpreter, at the same path inside the sandbox


_isolation_lock = threading.Lock()
_ISOLATION: _Isolation | tuple[str, str] | None = None  # the probe's result, or (problem, fix)


def _isolation() -> _Isolation:
    """The bubblewrap command line, probed once per process; raises `SandboxUnavailableError`."""
    global _ISOLATION
    with _isolation_lock:
        if _ISOLATION is None:
            try:
                _ISOLATION = _probe()
            except SandboxUnavailableError as exc:
                _ISOLATION = (exc.problem, exc.fix)
        found = _ISOLATION
    if isinstance(found, tuple):
        raise SandboxUnavailableError(*found)
    return found


def check_isolation() -> None:
    """Raise `SandboxUnavailableError` unless tool code can run isolated here (`ratchet doctor`)."""
    _isolation()


def _probe() -> _Isolation:
    bwrap = shutil.which("bwrap") or shutil.which("bwrap", path=os.defpath)
    if bwrap is None:
        raise SandboxUnavailableError(
            "tool sandbox unavailable: bubblewrap (bwrap) not found",
            "install it: apt-get install bubblewrap (./install.sh does)",
        )
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    isolation = _Isolation((bwrap, *_bwrap_options(python)), python)
    fds: list[int] = []
    try:
        check = "import os; print(os.getuid(), os.getcwd())"
        argv = _command(isolation, None, fds, seccomp=True) + ["-I", "-S", "-c", check]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=30, cwd="/", env={"PATH": os.defpath}, pass_fds=fds
        )
        reply, said = done.stdout.strip(), done.stderr.strip().splitlines()
        failure = said[-1] if said else f"exit code {done.returncode}"
        if done.returncode == 0:  # ran, but not as it should: e.g. a wrapper that does not isolate
            failure = f"the probe reported uid and cwd {reply!r}, not '{SANDBOX_UID} {SCRATCH}'"
    except (OSError, subprocess.TimeoutExpired) as exc:
        reply, failure = "", str(exc)
    finally:
        for fd in fds:
            os.close(fd)
    if reply != f"{SANDBOX_UID} {SCRATCH}":
        fix = (
            "install bubblewrap 0.8 or newer (Debian 12 has it)"
            if "nknown option" in failure
            else "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0; a container needs a profile that permits them)"
        )
        why = _one_line(failure)
        raise SandboxUnavailableError(
            f"tool sandbox unavailable: bubblewrap cannot set up its namespaces here ({why})", fix
        )
    return isolation


def _bwrap_options(python: str) -> list[str]:
    """Every namespace, no capabilities, and a read-only view of only what the interpreter needs."""
    options = [
        "--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID),
        "--gid", str(SANDBOX_UID), "--hostname", "sandbox", "--cap-drop", "ALL", "--die-with-parent",
        "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
        "--ro-bind", "/usr", "/usr",
    ]  # fmt: skip
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: /lib -> usr/lib
            options += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            options += ["--ro-bind", top, top]
    roots = ["/usr"]
    for path in sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}):
        if any(path == root or path.startswith(root + os.sep) for root in roots):
            continue
        roots.append(path)
        options += ["--ro-bind", path, path]
    if not any(python.startswith(root + os.sep) for root in roots):
        options += ["--ro-bind", os.path.dirname(python), os.path.dirname(python)]
    options += ["--dev", "/dev", "--remount-ro", "/dev", "--size", str(MAX_TMP_BYTES), "--tmpfs", "/tmp"]
    return options


def _seccomp_program() -> bytes | None:
    """A classic BPF program for `bwrap --seccomp`: EPERM for `_DENIED_SYSCALLS_X86_64`.

    None on other architectures, where the namespaces and the inner layers must do.
    """
    if platform.machine() != "x86_64" or struct.calcsize("P") != 8:
        return None

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:  # struct sock_filter
        return struct.pack("=HBBI", code, jt, jf, k)

    load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny, kill = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x80000000  # SECCOMP_RET_*
    numbers = sorted(set(_DENIED_SYSCALLS_X86_64.values()))
    program = [
        op(load, 4),  # seccomp_data.arch
        op(jeq, 0xC000003E, 1, 0),  # AUDIT_ARCH_X86_64; any other ABI (i386) is killed
        op(ret, kill),
        op(load, 0),  # seccomp_data.nr
        op(jge, 0x40000000, len(numbers) + 1, 0),  # the x32 ABI: refused
    ]
    program += [op(jeq, nr, len(numbers) - i, 0) for i, nr in enumerate(numbers)]
    program += [op(ret, allow), op(ret, deny)]
    return b"".join(program)


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
    if code > 128:  # bwrap reports a child killed by signal N as exit code 128 + N
        code = 128 - code
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


# The child, inside bubblewrap: set limits, install the inner guards (unless the tests turned
# them off), run the tool, write one marked JSON reply.
_CHILD = r'''
import io, json, os, resource, stat, sys

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
    realpath, fsdecode, sep, real_stat, is_dir = os.path.realpath, os.fsdecode, os.sep, os.stat, stat.S_ISDIR
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

    busy = []  # inside `inside`: realpath's own os.lstat calls skip the wrappers below

    def inside(path, roots):
        if path is None:
            path = "."
        if type(path) not in (str, bytes):  # no PathLike tricks: __fspath__ could change its mind
            return False
        busy.append(True)
        try:
            full = realpath(fsdecode(path))
        finally:
            busy.pop()
        return any(full == root or full.startswith(root + sep) for root in roots)

    def directory(path):
        try:
            return is_dir(real_stat(path).st_mode)
        except (OSError, ValueError):
            return False

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
            # The open event carries no dir_fd: a descriptor of a directory elsewhere would
            # let `os.open(name, ..., dir_fd=fd)` pass as a path in the scratch dir.
            if not inside(path, (scratch,)) and directory(path):
                raise PermissionError(f"sandbox blocked opening directory {path!r}: outside the scratch dir")
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

    def wrap(name, roots):  # calls CPython does not audit
        real = getattr(os, name)

        def checked(path, *args, **kwargs):
            relative = kwargs.get("dir_fd") is not None
            if not busy and (relative or (type(path) is not int and not inside(path, roots))):
                raise PermissionError(f"sandbox blocked os.{name} of {path!r}: outside the scratch dir")
            return real(path, *args, **kwargs)

        setattr(os, name, checked)

    for name in ("stat", "lstat"):
        wrap(name, read_roots)
    for name in ("mkfifo", "mknod"):
        wrap(name, (scratch,))

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
    if job["guards"]:
        install_guard(job["scratch"], tuple(job["blocked"]))
    reply = call(job)
    reply["output"] = captured.text()
    data = b"\n" + job["mark"].encode() + json.dumps(reply).encode()
    while data:
        data = data[os.write(1, data):]
    os._exit(0)

main()
'''
