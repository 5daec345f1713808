"""Run distilled tool code (untrusted, usually written by an LLM) in an isolated subprocess.

The layers, outermost first. The first is the wall; the others are tripwires that turn the
mistakes and prompt-injected tricks we expect into clear errors. The tests switch the inner
ones off (`validate=False`, `_INNER_GUARDS`, `_SECCOMP`) to prove the outer ones hold alone.
The child program that sets up layers 3 to 5 inside the sandbox is skills/sandbox_child.py,
passed to a stdlib-only interpreter with `-c`.

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
   sockets, mknod/mkfifo, memory that no rlimit counts (memfd_create, memfd_secret, SysV
   shared memory, message queues and semaphores, POSIX message queues), and mount,
   namespace, ptrace, bpf, keyring, io_uring, module and similar kernel interfaces
   (`_DENIED_SYSCALLS_X86_64`).
3. Resource limits, set by the child before the tool runs: a wall-clock timeout, and
   rlimits on CPU time, address space (anonymous and shared mmaps included), file size
   (which also caps each memfd), open files, core dumps, locked memory and POSIX message
   queues (both 0).
4. A CPython audit hook (`sys.addaudithook`) refuses network, process and FFI events,
   imports of such modules, tracing (`sys.settrace`/`setprofile`), writing, deleting or
   renaming outside the scratch dir, reading outside the scratch dir and the standard
   library, and opening directories elsewhere (whose descriptors would make `dir_fd=` calls
   look relative to the scratch dir); wrappers refuse `os.stat`/`lstat` and
   `os.mkfifo`/`mknod` outside those dirs, which CPython does not audit. The hook and the
   wrappers keep nothing tool code could rewire: no closures, globals or builtins by name,
   only bound tuples of immutable values and C functions (their own realpath, since
   os.path.realpath's module globals can be changed), and the hook refuses replacing their
   `__code__` or `__defaults__`.
5. The interpreter allow-list (`validate=True`). `validate_tool_code` reads the AST before
   anything runs: a top-level `def run(...)`; imports only of the modules in
   `ALLOWED_IMPORTS`, and from each only the names listed there (its own public functions,
   classes and constants: never a submodule or a module it imported, as in
   `re.enum.bltns.eval` or `json.codecs.open`, and never an API that reads attribute paths or
   code named by a string, as `operator.attrgetter`, `functools.update_wrapper`,
   `string.Formatter`, `typing.get_type_hints`); a module name used only as `module.name`,
   never stored, passed or returned, and no `import` in a class body; no `eval`/`exec`/
   `open`/`getattr`/`__import__`...; no dunder or private attributes of other objects, no
   frame attributes, no `.format_map`, no `.format` on computed templates or with
   `{0.attr}` / `{0[key]}` fields; top-level code limited to imports, defs and constants.
   No module or name on the list turns a string into code (`dataclasses`, `namedtuple` are
   off it). Its runtime twin, in the child: the tool's `import` yields a view of the module
   holding only the listed names, its builtins lack the forbidden ones, and `exec`/`eval`
   of text a library runs for the tool get those reduced builtins too (refused in a real
   module's namespace). The return value must be JSON; prints are captured and capped.

What this does NOT cover:

* Kernel bugs, and CPU or memory side channels: namespaces, mounts and seccomp are
  enforced by the kernel the tool shares with the host, and a kernel exploit escapes them.
* Reading what is mounted: the tool can read the read-only /usr and the Python
  installation (including its site-packages), anything the caller puts in `scratch_dir`,
  and of course its own arguments. Don't pass secrets to a tool.
* Resource use within the limits: CPU for up to `timeout_s`; memory of `memory_mb` of
  address space plus the tmpfs caps (`MAX_TMP_BYTES` + `MAX_SCRATCH_BYTES`) and a few pipe
  buffers; and, in a caller-supplied `scratch_dir`, disk space bounded only by the timeout
  and the file-size limit. There is no memory cgroup (an unprivileged bubblewrap cannot
  make one), so memory outside the address space is bounded by seccomp and the rlimits.
* Without seccomp (not x86_64, or `_SECCOMP` off), a tool that gets past the interpreter
  layer can start processes until the timeout ends them (each with its own limits), hold
  up to `MAX_OPEN_FILES` x `MAX_FILE_BYTES` (1 GiB) per process in memfds, and hold SysV
  shared memory, message queues and semaphores bounded only by the IPC namespace's
  host-default shmall/msgmni/semmni, until the call ends.
* Inside the user namespace the tool is uid 65534, but outside it is the user who runs
  ratchet (an unprivileged bubblewrap can only map its caller's uid): files it creates in
  a caller-supplied scratch dir belong to that user, mode bits included (it can leave a
  set-uid file there: keep such a dir private and never run what is in it), and any host
  path that were mounted writable by mistake would be writable as that user.
* Its own output and result: the value is whatever the tool computed, and code that gets
  past the interpreter layer owns the real stdout and can forge a whole reply (an error, a
  value past `MAX_RESULT_BYTES`...). Treat the value as untrusted data, not as instructions.
* The inner layers alone: modules and their names are allow-listed, but the attributes of
  the objects they return are checked by a deny-list (dunder, private, frame and
  text-evaluating names), and the runtime views guard module attributes only, not a walk
  from an object (`fn.__globals__` if the AST check were wrong); the audit hook is a
  CPython-level tripwire. Code past them can put the unwrapped `os.stat` back (a fresh
  `posix` module from the import system has one) and then stat any path the OS layer
  shows. Native code, an interpreter bug or a clever object walk gets past them, which is
  why the OS isolation exists.

Cost per call (2 shared cores, medians of 40, measured side by side): bubblewrap adds ~4 ms
to the interpreter's start (`python -c pass`: 8.7 -> 12.4 ms) and the seccomp filter ~1 ms,
but a whole call of a trivial tool went from 33.2 to 25.8 ms, because the wait now wakes on
a pidfd instead of polling and the scratch dir is a tmpfs instead of a host temp dir. The
interpreter allow-list costs ~0.15 ms of validation and ~1.5 ms per call (25.3 -> 26.7 ms,
medians of 80), mostly compiling the longer child program.
"""

from __future__ import annotations

import _thread
import ast
import errno
import functools
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
MAX_TIMEOUT_S = 86_400.0  # a day, the settings' bound on every timeout (ratchet/config.py DAY_S)
MAX_MEMORY_MB = 2**20  # 1 TiB of address space; its bytes still fit an rlimit
SCRATCH = "/scratch"  # where the scratch dir is, inside the sandbox
SANDBOX_UID = 65534  # `nobody`, inside the sandbox's user namespace

# Private knobs for the tests, which switch layers off to prove the others hold on their own.
_INNER_GUARDS = True  # the audit hook, the import block-list and the os.stat/mkfifo wrappers
_SECCOMP = True  # the syscall filter (x86_64 only)


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# What tool code may import, and the only names it may use from each module: the public
# functions, classes and constants that module defines. Never a submodule or a module it
# imported (`re.enum.bltns.eval`, `json.codecs.open`), never an API that reads attribute
# paths or code named by a string (`operator.attrgetter`, `functools.update_wrapper(...,
# assigned=("__builtins__",))`, `string.Formatter`, `typing.get_type_hints`...), and never one
# that turns strings into code: `dataclasses` pastes field names into the source it `exec`s
# with the real builtins (a field named `__class__,exec(...))#` ran the tool's payload with
# every layer on), and `collections.namedtuple` / `typing.NamedTuple` `eval` theirs.
# tests/test_sandbox_allowlist.py calls every name here with string data and reviews every
# exec/eval/compile/__import__ in the code these modules load. The AST check enforces the list
# before the run, and the child again at run time (skills/sandbox_child.py).
ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "math": _names(
        "acos acosh asin asinh atan atan2 atanh cbrt ceil comb copysign cos cosh degrees dist e erf "
        "erfc exp exp2 expm1 fabs factorial floor fmod frexp fsum gamma gcd hypot inf isclose isfinite "
        "isinf isnan isqrt lcm ldexp lgamma log log10 log1p log2 modf nan nextafter perm pi pow prod "
        "radians remainder sin sinh sqrt tan tanh tau trunc ulp"
    ),
    "re": _names(
        "A ASCII DOTALL I IGNORECASE L LOCALE M MULTILINE Match NOFLAG Pattern RegexFlag S U UNICODE "
        "VERBOSE X compile error escape findall finditer fullmatch match purge search split sub subn"
    ),
    "json": _names("JSONDecodeError JSONDecoder JSONEncoder dump dumps load loads"),
    "itertools": _names(
        "accumulate chain combinations combinations_with_replacement compress count cycle dropwhile "
        "filterfalse groupby islice pairwise permutations product repeat starmap takewhile tee zip_longest"
    ),
    "functools": _names(
        "cache cached_property cmp_to_key lru_cache partial partialmethod reduce total_ordering"
    ),
    "collections": _names("ChainMap Counter OrderedDict UserDict UserList UserString defaultdict deque"),
    "collections.abc": _names(
        "AsyncGenerator AsyncIterable AsyncIterator Awaitable ByteString Callable Collection Container "
        "Coroutine Generator Hashable ItemsView Iterable Iterator KeysView Mapping MappingView "
        "MutableMapping MutableSequence MutableSet Reversible Sequence Set Sized ValuesView"
    ),
    "statistics": _names(
        "NormalDist StatisticsError correlation covariance fmean geometric_mean harmonic_mean "
        "linear_regression mean median median_grouped median_high median_low mode multimode pstdev "
        "pvariance quantiles stdev variance"
    ),
    "fractions": _names("Fraction"),
    "decimal": _names(
        "BasicContext Clamped Context ConversionSyntax Decimal DecimalException DecimalTuple "
        "DefaultContext DivisionByZero DivisionImpossible DivisionUndefined ExtendedContext "
        "FloatOperation HAVE_CONTEXTVAR HAVE_THREADS Inexact InvalidContext InvalidOperation MAX_EMAX "
        "MAX_PREC MIN_EMIN MIN_ETINY Overflow ROUND_05UP ROUND_CEILING ROUND_DOWN ROUND_FLOOR "
        "ROUND_HALF_DOWN ROUND_HALF_EVEN ROUND_HALF_UP ROUND_UP Rounded Subnormal Underflow getcontext "
        "localcontext setcontext"
    ),
    "string": _names(
        "Template ascii_letters ascii_lowercase ascii_uppercase capwords digits hexdigits octdigits "
        "printable punctuation whitespace"
    ),
    "operator": _names(
        "abs add and_ call concat contains countOf delitem eq floordiv ge getitem gt iadd iand iconcat "
        "ifloordiv ilshift imatmul imod imul index indexOf inv invert ior ipow irshift is_ is_not isub "
        "itemgetter itruediv ixor le length_hint lshift lt matmul mod mul ne neg not_ or_ pos pow rshift "
        "setitem sub truediv truth xor"
    ),
    "heapq": _names("heapify heappop heappush heappushpop heapreplace merge nlargest nsmallest"),
    "bisect": _names("bisect bisect_left bisect_right insort insort_left insort_right"),
    "datetime": _names("MAXYEAR MINYEAR UTC date datetime time timedelta timezone tzinfo"),
    "random": _names(
        "Random SystemRandom betavariate choice choices expovariate gammavariate gauss getrandbits "
        "getstate lognormvariate normalvariate paretovariate randbytes randint random randrange sample "
        "seed setstate shuffle triangular uniform vonmisesvariate weibullvariate"
    ),
    "typing": _names(
        "AbstractSet Annotated Any AnyStr AsyncContextManager AsyncGenerator AsyncIterable "
        "AsyncIterator Awaitable BinaryIO ByteString Callable ChainMap ClassVar Collection Concatenate "
        "Container ContextManager Coroutine Counter DefaultDict Deque Dict Final FrozenSet Generator "
        "Generic Hashable IO ItemsView Iterable Iterator KeysView List Literal LiteralString Mapping "
        "MappingView Match MutableMapping MutableSequence MutableSet Never NewType NoReturn "
        "NotRequired Optional OrderedDict ParamSpec ParamSpecArgs ParamSpecKwargs Pattern Protocol "
        "Required Reversible Self Sequence Set Sized SupportsAbs SupportsBytes SupportsComplex "
        "SupportsFloat SupportsIndex SupportsInt SupportsRound TYPE_CHECKING Text TextIO Tuple Type "
        "TypeAlias TypeGuard TypeVar TypeVarTuple TypedDict Union Unpack ValuesView assert_never "
        "assert_type cast final get_args get_origin is_typeddict overload runtime_checkable"
    ),
    "textwrap": _names("TextWrapper dedent fill indent shorten wrap"),
    "unicodedata": _names(
        "UCD bidirectional category combining decimal decomposition digit east_asian_width "
        "is_normalized lookup mirrored name normalize numeric ucd_3_2_0 unidata_version"
    ),
}
ALLOWED_MODULES = frozenset(ALLOWED_IMPORTS)
FORBIDDEN_NAMES = frozenset(
    "eval exec compile open __import__ globals locals vars getattr setattr delattr input "
    "breakpoint memoryview help exit quit".split()
)
# Attributes refused on any object. A module's attributes are allow-listed above; this
# deny-list covers the objects tool code holds, whose type the AST check cannot know: names
# that lead into the interpreter's internals (frames, and `x.sys`, `x.os`... on anything), or
# that evaluate text as code or attribute paths (`string.Formatter().get_field("0.__class__...")`
# returns live objects, `typing.get_type_hints` / `functools.singledispatch` `eval` string
# annotations). Checked first on modules too, so `operator.attrgetter` gets one reason everywhere.
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
# processes and threads, sockets, device nodes and FIFOs, memory that no rlimit counts, and
# kernel interfaces a pure computation never needs (mounts, namespaces, ptrace, bpf, keyrings,
# io_uring, modules...).
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
    # memory outside RLIMIT_AS and the tmpfs caps: memfds, SysV shared memory and message
    # queues and semaphores (held by the IPC namespace, not the process), POSIX message queues
    "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67,
    "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semget": 64, "semop": 65, "semctl": 66,
    "semtimedop": 220, "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243,
    "mq_notify": 244, "mq_getsetattr": 245,
}  # fmt: skip


class SandboxUnavailableError(RatchetError):
    """The OS-level isolation cannot be set up here, so no tool code is run at all."""


class UnsafeCodeError(RatchetError):
    """Tool code that the static check refuses to run."""


class ToolCallError(RatchetError, ValueError):
    """A call `run_tool` cannot make: a limit out of range (a timeout of inf or nan), arguments
    that are not JSON, or a caller too deep in its stack. The settings refuse such limits; a
    library caller gets the same one line instead of an OverflowError from deep inside."""


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
    except (RecursionError, MemoryError):  # CPython's parser on e.g. 10,000 nested `not`s
        raise UnsafeCodeError("tool code is nested too deeply to check", "flatten its expressions") from None
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
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    modules = _imported_modules(tree, parents)
    for node in ast.walk(tree):
        _check_node(node, modules, parents)


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


def _imported_modules(tree: ast.Module, parents: dict[ast.AST, ast.AST]) -> dict[str, str]:
    """Check every import against `ALLOWED_IMPORTS`; the names bound to modules, and which."""
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        scope = parents[node]
        while not isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = parents[scope]
        if isinstance(scope, ast.ClassDef):  # `C.re` would be the module, past every check below
            _refuse(node, "`import` in a class body", "import at the top of the tool or in a function")
        if isinstance(node, ast.ImportFrom):
            _check_import_from(node)
            continue
        for alias in node.names:
            _check_module(node, alias.name)
            if "." in alias.name:  # binds the package, whose submodules are not on the list
                _refuse(node, f"`import {alias.name}`", f"write `from {alias.name} import name`")
            bound = alias.asname or alias.name
            if modules.setdefault(bound, alias.name) != alias.name:
                _refuse(node, f"`{bound}` names two modules", "import each module under its own name")
    return modules


def _check_import_from(node: ast.ImportFrom) -> None:
    if node.level:
        _refuse(node, "relative import", "import from the standard library by its full name")
    module = node.module or ""
    _check_module(node, module)
    for alias in node.names:
        if alias.name == "*":
            _refuse(node, f"`from {module} import *`", "import the names the tool uses")
        _check_attr(node, alias.name, owner=None)
        if alias.name not in ALLOWED_IMPORTS[module]:
            _refuse(node, f"`from {module} import {alias.name}`", _allowed_names(module))


def _check_module(node: ast.AST, module: str) -> None:
    if module not in ALLOWED_IMPORTS:
        _refuse(node, f"import of `{module}`", "tools may import only " + ", ".join(sorted(ALLOWED_MODULES)))


def _allowed_names(module: str) -> str:
    return f"tools may use only the names on `{module}`'s allow-list (skills/sandbox.py ALLOWED_IMPORTS)"


def _check_node(node: ast.AST, modules: dict[str, str], parents: dict[ast.AST, ast.AST]) -> None:
    if isinstance(node, ast.Name):
        if node.id in FORBIDDEN_NAMES or node.id.startswith("__"):
            _refuse(node, f"use of `{node.id}`", "tools may only compute on their arguments")
        if node.id in modules:  # a module is only ever `module.name`: never stored, passed or returned
            parent = parents.get(node)
            if not (isinstance(parent, ast.Attribute) and parent.value is node):
                _refuse(
                    node,
                    f"`{node.id}` used other than as `{node.id}.name`",
                    f"use the module's names directly, e.g. `{node.id}.name(...)`",
                )
    elif isinstance(node, ast.Attribute):
        _check_attr(node, node.attr, owner=node.value)
        if isinstance(node.value, ast.Name) and node.value.id in modules:
            module = modules[node.value.id]
            if node.attr not in ALLOWED_IMPORTS[module]:
                _refuse(node, f"access to `{module}.{node.attr}`", _allowed_names(module))
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
    when the OS-level isolation is unavailable (`SandboxUnavailableError`). A timeout or
    memory limit out of range, or arguments that are not JSON, raise `ToolCallError`.

    The scratch dir is `/scratch` inside: a fresh tmpfs of `MAX_SCRATCH_BYTES` that
    vanishes with the call, or `scratch_dir` from the host, bound read-write. Nothing here
    reads the scratch dir afterwards.

    The call runs on a thread of its own, started and awaited with C calls only (a
    `threading.Thread` takes a dozen Python frames to start): a caller deep in a recursion
    gets its result like any other, never a RecursionError from halfway through with a child
    left running.
    """
    outcome: list[SandboxResult | BaseException] = []
    try:
        done = _thread.allocate_lock()
        done.acquire()
        _thread.start_new_thread(
            _keep, (outcome, done, source, args, entry, timeout_s, memory_mb, scratch_dir, validate)
        )
        done.acquire()  # released by the worker; a signal (Ctrl-C) still interrupts it
    except RecursionError:  # the caller used up the stack to the last frame
        raise ToolCallError(
            "run_tool was called too deep in the stack",
            f"call it with room below the recursion limit ({sys.getrecursionlimit()})",
        ) from None
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _keep(outcome: list[SandboxResult | BaseException], done: Any, *call: Any) -> None:
    """The worker thread: leaves the result, or the exception, for the caller's thread to return or
    raise. Nothing waits for it at exit; bwrap's --die-with-parent then ends the sandbox with it."""
    try:
        outcome.append(_run_tool(*call))
    except BaseException as exc:
        outcome.append(exc)
    finally:
        done.release()


def _check_limits(timeout_s: object, memory_mb: object) -> None:
    """What the settings allow (ratchet/config.py) is what run_tool can enforce; nan, inf and
    1e300 otherwise surfaced as OverflowError from math.ceil or poll."""
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 < timeout_s <= MAX_TIMEOUT_S
    ):
        raise ToolCallError(
            f"tool timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f}, "
            f"not {_one_line(repr(timeout_s), 60)}",
            "pass a finite timeout_s (the settings' tool_timeout_s is one)",
        )
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or not 1 <= memory_mb <= MAX_MEMORY_MB:
        raise ToolCallError(
            f"tool memory limit must be a whole number of MB from 1 to {MAX_MEMORY_MB}, "
            f"not {_one_line(repr(memory_mb), 60)}",
            "pass memory_mb as the settings' tool_memory_mb",
        )


def _run_tool(
    source: str,
    args: dict[str, Any],
    entry: str,
    timeout_s: float,
    memory_mb: int,
    scratch_dir: Path | None,
    validate: bool,
) -> SandboxResult:
    _check_limits(timeout_s, memory_mb)
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
        "RLIMIT_MEMLOCK": (0, 0),  # nothing to pin: memfd_secret, mlock
        "RLIMIT_MSGQUEUE": (0, 0),  # no POSIX message queues, which hold memory outside RLIMIT_AS
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
        # the allow-list's runtime twin: views of the allowed modules, builtins without eval...
        "modules": {m: sorted(names) for m, names in ALLOWED_IMPORTS.items()} if validate else None,
        "forbidden": sorted(FORBIDDEN_NAMES),
        "mark": _RESULT_MARK.decode(),
        "max_result": MAX_RESULT_BYTES,
        "max_output": MAX_OUTPUT_CHARS,
    }
    try:
        encoded = json.dumps(job).encode()
    except (TypeError, ValueError, RecursionError) as exc:  # a set, an object, a cycle, 1,000 nested lists
        raise ToolCallError(
            f"tool arguments are not JSON ({_one_line(exc, 120)})",
            "pass dicts with str keys, lists, str, numbers, booleans and None",
        ) from None
    # Anonymous files, not pipes: no deadlock, no path the tool could open, and
    # RLIMIT_FSIZE caps whatever the child writes to them.
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout:
        stdin.write(encoded)
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
        argv += ["-I", "-S", "-B", "-X", "utf8", "-c", _child_source()]
        return subprocess.Popen(
            argv, stdin=stdin, stdout=stdout, stderr=subprocess.STDOUT, cwd="/",
            env={"PATH": os.defpath, "LANG": "C.UTF-8"}, start_new_session=True, pass_fds=fds,
        )  # fmt: skip
    finally:
        for fd in fds:
            os.close(fd)


@functools.cache
def _child_source() -> str:
    """skills/sandbox_child.py, passed with `-c`: no host path to bind, and a stdlib-only run."""
    return (Path(__file__).parent / "sandbox_child.py").read_text(encoding="utf-8")


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
