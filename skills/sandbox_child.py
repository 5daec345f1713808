"""The sandbox's child program: set the limits, install the inner guards, run the tool, reply.

`skills/sandbox.py` runs this file's text inside bubblewrap as
`python -I -S -B -X utf8 -c <source>`, with a JSON job on stdin, so it sees only the standard
library: it must import nothing else (no ratchet, no third-party package). It writes one marked
JSON reply as the last thing on stdout.

When the job carries `modules` (run_tool's `validate=True`), the tool runs with the runtime
twin of the AST allow-list: its `import` gives it a view of each module holding only the
allow-listed names (never a submodule or another module), and its builtins lack `eval`,
`open`, `getattr`... so an object walk the static check missed still finds nothing there;
and text a library `exec`s or `eval`s for it runs with those builtins too (`seal_builtins`).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import resource
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # no `typing` import at run time: every import is paid on each call
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any, NoReturn


class Capped(io.TextIOBase):
    """Keeps the first `cap` characters the tool prints, so prints never reach the protocol."""

    def __init__(self, cap: int) -> None:
        self.cap, self.size = cap, 0
        self.parts: list[str] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self.size < self.cap:
            self.parts.append(text[: self.cap - self.size])
            self.size += len(self.parts[-1])
        return len(text)

    def text(self) -> str:
        return "".join(self.parts) + ("\n[output truncated]" if self.size >= self.cap else "")


# The guard's functions below hold no state of their own: each is bound (`fn.__get__(state)`)
# to a tuple of immutable values (str, tuples, frozensets, C functions), and uses no globals,
# no closures and no builtins by name, since tool code that got past the allow-list can rewrite
# all of those (the review's attack replaced `realpath` in a closure cell of the os.stat
# wrapper). What is left to rewrite is a function's `__code__` and `__defaults__`, which CPython
# audits and `_audit` refuses for these functions. tests/test_sandbox.py checks their bytecode.


def _resolve(c: tuple, path: str) -> str:
    """`path` with every symlink followed, as os.path.realpath does (a Python function whose
    module globals tool code could change), from C functions only; "" for a symlink loop."""
    lstat, readlink, getcwd, item, failure = c
    if not path.startswith("/"):
        path = getcwd() + "/" + path
    done: list[str] = []
    todo = path.split("/")
    todo.reverse()
    links = 0
    while todo:
        name = todo.pop()
        if name == "" or name == ".":
            continue
        if name == "..":
            if done:
                done.pop()
            continue
        done.append(name)
        current = "/" + "/".join(done)
        try:
            mode = item(lstat(current), 0)  # tuple.__getitem__: os.stat_result's own attributes can be set
        except failure:
            continue  # missing: kept as written, like realpath
        if mode & 0o170000 != 0o120000:
            continue
        links += 1
        if links > 40:
            return ""
        target = readlink(current)
        done.pop()
        if target.startswith("/"):
            done.clear()
        parts = target.split("/")
        parts.reverse()
        todo.extend(parts)
    return "/" + "/".join(done)


def _inside(c: tuple, path: object, roots: tuple[str, ...]) -> bool:
    """Whether `path` (a str or bytes, nothing that could change its mind) resolves under a root."""
    resolve, kind, text, raw, decode, failures = c
    if path is None:
        path = "."
    if kind(path) is raw:
        path = decode(path, "utf-8", "surrogateescape")
    elif kind(path) is not text:
        return False
    try:
        full = resolve(path)
    except failures:
        return False
    for root in roots:
        if full == root or full.startswith(root + "/"):
            return True
    return False


def _directory(c: tuple, path: object) -> bool:
    """Whether `path` is a directory, without os.stat_result's attributes (they can be set)."""
    stat, item, failures = c
    try:
        return item(stat(path), 0) & 0o170000 == 0o040000
    except failures:
        return False


def _audit(c: tuple, event: object, args: tuple) -> None:
    """The audit hook: refuses network, process and FFI events, blocked imports, tracing, file
    access outside the scratch dir (reads: also the stdlib), and rewriting the guard itself."""
    (denied, prefixes, blocked, path_names, path_table, scratch, read_roots, inside, directory,
     protected, kind, text, raw, number, write_flags, count, refuse) = c  # fmt: skip
    if kind(event) is not text:
        return  # `sys.audit` with a str subclass: tool code raising an event of its own
    if event in denied or event.startswith(prefixes):
        raise refuse(f"sandbox blocked {event}")
    if event == "import":
        name = args[0]
        if kind(name) is not text:
            raise refuse("sandbox blocked import of a name that is not a str")
        for module in blocked:
            if name == module or name.startswith(module + "."):
                raise refuse(f"sandbox blocked import of {name!r}")
    elif event == "open":
        path, mode, flags = args
        if kind(mode) is text:
            writing = "w" in mode or "a" in mode or "x" in mode or "+" in mode
        else:  # os.open: the flags say it
            writing = kind(flags) is not number or flags & write_flags != 0
        if kind(path) is number and not writing:
            return  # reading an already-open descriptor
        if not inside(path, (scratch,) if writing else read_roots):
            if kind(path) is text or kind(path) is raw or kind(path) is number:
                what = f"file descriptor {path}" if kind(path) is number else f"{path!r}"
            else:
                what = "a path that is not a str or bytes"
            verb = "writing" if writing else "reading"
            raise refuse(f"sandbox blocked {verb} {what}: outside the scratch dir")
        # The open event carries no dir_fd: a descriptor of a directory elsewhere would let
        # `os.open(name, ..., dir_fd=fd)` pass as a path in the scratch dir.
        if not inside(path, (scratch,)) and directory(path):
            raise refuse(f"sandbox blocked opening directory {path!r}: outside the scratch dir")
    elif event == "os.listdir" or event == "os.scandir":
        if kind(args[0]) is not number and not inside(args[0], read_roots):
            where = f"{args[0]!r}" if kind(args[0]) is text or kind(args[0]) is raw else "a path object"
            raise refuse(f"sandbox blocked listing {where}: outside the scratch dir")
    elif event in path_names:
        for name, paths, dir_fds in path_table:
            if name == event:
                for i in dir_fds:
                    if i < count(args) and args[i] is not None and args[i] != -1:
                        raise refuse(f"sandbox blocked {event} outside the scratch dir")
                for i in paths:
                    if kind(args[i]) is not number and not inside(args[i], (scratch,)):
                        raise refuse(f"sandbox blocked {event} outside the scratch dir")
    elif event == "object.__setattr__":  # a function's __code__, __defaults__ or __kwdefaults__
        for fn in protected:
            if args[0] is fn:
                raise refuse("sandbox blocked changing its guard")


def _checked_call(c: tuple, path: object, *args: Any, **kwargs: Any) -> Any:
    """What os.stat, lstat, mkfifo and mknod become: CPython does not audit them."""
    real, name, roots, inside, kind, text, raw, number, refuse = c
    if kwargs.get("dir_fd") is not None or (kind(path) is not number and not inside(path, roots)):
        where = f"{path!r}" if kind(path) is text or kind(path) is raw else "a path object"
        raise refuse(f"sandbox blocked os.{name} of {where}: outside the scratch dir")
    return real(path, *args, **kwargs)


def install_guard(scratch: str, blocked: tuple[str, ...]) -> None:
    """The audit hook and the os wrappers: tripwires for what CPython does (or does not) audit."""
    failures = (OSError, ValueError)
    resolve = _resolve.__get__((os.lstat, os.readlink, os.getcwd, tuple.__getitem__, OSError))
    inside = _inside.__get__((resolve, type, str, bytes, bytes.decode, failures))
    directory = _directory.__get__((os.stat, tuple.__getitem__, failures))
    read_roots = (scratch, *[resolve(p) for p in sys.path if p])
    denied = frozenset(
        """subprocess.Popen os.system os.exec os.spawn os.posix_spawn os.fork
        os.forkpty os.kill os.killpg os.chdir os.symlink os.startfile resource.setrlimit
        resource.prlimit signal.pthread_kill gc.get_objects gc.get_referrers gc.get_referents
        webbrowser.open sys.settrace sys.setprofile""".split()
    )  # tracing would let tool code rewrite the guard's locals while it runs
    # event, positions of paths, positions of dir_fd arguments
    path_table = (
        ("os.remove", (0,), (1,)), ("os.rmdir", (0,), (1,)), ("os.mkdir", (0,), (2,)),
        ("os.chmod", (0,), (2,)), ("os.chown", (0,), (3,)), ("os.utime", (0,), (3,)),
        ("os.truncate", (0,), ()), ("os.rename", (0, 1), (2, 3)), ("os.link", (0, 1), (2, 3)),
        ("os.setxattr", (0,), ()), ("os.removexattr", (0,), ()),
    )  # fmt: skip
    state = (
        denied, ("socket.", "ctypes.", "syslog."), blocked, frozenset(e[0] for e in path_table), path_table,
        scratch, read_roots, inside, directory, GUARD_FUNCTIONS, type, str, bytes, int,
        os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC, len, PermissionError,
    )  # fmt: skip
    sys.addaudithook(_audit.__get__(state))
    for name, roots in (
        ("stat", read_roots),
        ("lstat", read_roots),
        ("mkfifo", (scratch,)),
        ("mknod", (scratch,)),
    ):
        state = (getattr(os, name), name, roots, inside, type, str, bytes, int, PermissionError)
        wrapper = _checked_call.__get__(state)
        setattr(os, name, wrapper)


def _sealed(c: tuple, source: object, globals: object = None, locals: object = None, /, **kwargs: Any) -> Any:
    """What exec and eval become while the tool runs with the allow-list: text a library runs for
    the tool (dataclasses, namedtuple...) gets the tool's reduced builtins, not the real ones that
    exec would fill in, and is refused in a real module's namespace, where `sys` or `os` may be."""
    (real, verb, reduced, real_builtins, modules, module_type, code_type, kind, text, dictionary, missing,
     refuse) = c  # fmt: skip
    if kind(globals) is not dictionary:
        raise refuse(f"sandbox blocked {verb} without a namespace dict")
    if globals is real_builtins:
        raise refuse(f"sandbox blocked {verb} in the builtins' namespace")
    found = dictionary.get(globals, "__builtins__", missing)
    name = dictionary.get(globals, "__name__")
    if found is missing:
        module = dictionary.get(modules, name) if kind(name) is text else None
        # the import system running a module's file in its fresh namespace
        importing = kind(source) is code_type and kind(module) is module_type and module.__dict__ is globals
        if not importing:
            dictionary.__setitem__(globals, "__builtins__", reduced)
    elif found is real_builtins or kind(found) is module_type:
        what = f"module {name!r}" if kind(name) is text else "a module"
        raise refuse(f"sandbox blocked {verb} in the namespace of {what}")
    return real(source, globals, locals, **kwargs)


def seal_builtins(reduced: dict[str, Any]) -> None:
    """Make exec and eval run text for the tool with `reduced` as its builtins (see `_sealed`)."""
    for verb in ("exec", "eval"):
        state = (
            getattr(builtins, verb), verb, reduced, vars(builtins), sys.modules, type(sys),
            type(seal_builtins.__code__), type, str, dict, object(), PermissionError,
        )  # fmt: skip
        setattr(builtins, verb, _sealed.__get__(state))


GUARD_FUNCTIONS = (_resolve, _inside, _directory, _audit, _checked_call, _sealed)


class ModuleView:
    """What `import m` gives tool code: only m's allow-listed names, as attributes.

    It has no `__name__`, so `from m import x` for a name not here cannot fall back to a real
    submodule `m.x` in `sys.modules` (CPython's IMPORT_FROM tries that).
    """

    __slots__ = ("__dict__", "_module")

    def __init__(self, module: str, values: Mapping[str, object]) -> None:
        self._module = module
        self.__dict__.update(values)

    def __getattr__(self, attr: str) -> NoReturn:
        raise AttributeError(
            f"module {self._module!r} has no attribute {attr!r} in the sandbox (not on its allow-list)"
        )

    def __repr__(self) -> str:
        return f"<module {self._module!r} (sandbox view)>"


def tool_builtins(allowed: Mapping[str, Sequence[str]], forbidden: Sequence[str]) -> dict[str, Any]:
    """The builtins tool code runs with: the public ones but `forbidden`, and an `__import__`
    that hands out `ModuleView`s of the allowed modules only."""
    views: dict[str, ModuleView] = {}
    real_import: Callable[..., Any] = builtins.__import__

    def tool_import(
        name: str, globals: object = None, locals: object = None, fromlist: Sequence[str] = (), level: int = 0
    ) -> ModuleView | None:
        if type(fromlist) is list:
            # C code importing for itself (`datetime.strptime` needs `_strptime`) calls the current
            # frame's `__import__` with an empty list (PyImport_Import), ignores what it returns
            # and reads sys.modules; the `import` statement passes None or a tuple. Import, give
            # nothing back: a tool calling this way gets no module either.
            real_import(name)
            return None
        # `import a.b` binds `a`, whose view has no `b`: only `from a.b import x` reaches a.b.
        if level or name not in allowed or ("." in name and not fromlist):
            raise ImportError(f"tool code may not import {'.' * level + name!r}")
        if name not in views:
            real_import(name)
            module = sys.modules[name]
            views[name] = ModuleView(name, {attr: getattr(module, attr) for attr in allowed[name]})
        return views[name]

    names = {k: v for k, v in vars(builtins).items() if not k.startswith("_") and k not in forbidden}
    names["__build_class__"] = builtins.__build_class__  # `class` statements need it
    names["__import__"] = tool_import
    return names


def describe(exc: BaseException) -> str:
    """One line: the exception's type and message, and the tool's line it came from."""
    text = " ".join(str(exc).split())
    text = (text[:297] + "...") if len(text) > 300 else text
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<tool>":
            line = tb.tb_lineno
        tb = tb.tb_next
    where = f" (line {line})" if line else ""
    return f"{type(exc).__name__}: {text}{where}" if text else f"{type(exc).__name__}{where}"


def call(job: dict[str, Any]) -> dict[str, Any]:
    """Run the tool's entry on its arguments; the reply without its output."""
    try:
        namespace: dict[str, Any] = {"__name__": "tool"}
        if job["modules"] is not None:
            namespace["__builtins__"] = tool_builtins(job["modules"], job["forbidden"])
            seal_builtins(namespace["__builtins__"])
        # dont_inherit: not this file's `from __future__ import annotations`, which would turn
        # the tool's annotations into strings
        exec(compile(job["source"], "<tool>", "exec", dont_inherit=True), namespace)
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


def main() -> None:
    """Limits first, then the guards, then the tool; the reply goes straight to descriptor 1."""
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
        data = data[os.write(1, data) :]
    os._exit(0)


if __name__ == "__main__":
    main()
