"""The sandbox's child program: set the limits, install the inner guards, run the tool, reply.

`skills/sandbox.py` runs this file's text inside bubblewrap as
`python -I -S -B -X utf8 -c <source>`, with a JSON job on stdin, so it sees only the standard
library: it must import nothing else (no ratchet, no third-party package). It writes one marked
JSON reply as the last thing on stdout.

When the job carries `modules` (run_tool's `validate=True`), the tool runs with the runtime
twin of the AST allow-list: its `import` gives it a view of each module holding only the
allow-listed names (never a submodule or another module), and its builtins lack `eval`,
`open`, `getattr`... so an object walk the static check missed still finds nothing there.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import resource
import stat
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


def install_guard(scratch: str, blocked: tuple[str, ...]) -> None:
    """The audit hook and the os wrappers: tripwires for what CPython does (or does not) audit."""
    realpath, fsdecode, sep, real_stat, is_dir = os.path.realpath, os.fsdecode, os.sep, os.stat, stat.S_ISDIR
    read_roots = (scratch,) + tuple(realpath(p) for p in sys.path if p)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    denied = frozenset(
        """subprocess.Popen os.system os.exec os.spawn os.posix_spawn os.fork
        os.forkpty os.kill os.killpg os.chdir os.symlink os.startfile resource.setrlimit
        resource.prlimit signal.pthread_kill gc.get_objects
        gc.get_referrers gc.get_referents webbrowser.open""".split()
    )
    # event: (positions of paths, positions of dir_fd arguments)
    path_events = {
        "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
        "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)),
        "os.truncate": ((0,), ()), "os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)),
        "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
    }  # fmt: skip

    busy: list[bool] = []  # inside `inside`: realpath's own os.lstat calls skip the wrappers below

    def inside(path: object, roots: tuple[str, ...]) -> bool:
        if path is None:
            path = "."
        if type(path) not in (str, bytes):  # no PathLike tricks: __fspath__ could change its mind
            return False
        busy.append(True)
        try:
            full = realpath(fsdecode(path))  # type: ignore[arg-type]
        finally:
            busy.pop()
        return any(full == root or full.startswith(root + sep) for root in roots)

    def directory(path: Any) -> bool:
        try:
            return is_dir(real_stat(path).st_mode)
        except (OSError, ValueError):
            return False

    def guard(event: str, args: tuple[Any, ...]) -> None:
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
                type(args[i]) is int or inside(args[i], (scratch,)) for i in paths
            ):
                raise PermissionError(f"sandbox blocked {event} outside the scratch dir")
        elif event == "object.__setattr__" and args[0] is guard:
            raise PermissionError("sandbox blocked changing its guard")

    sys.addaudithook(guard)

    def wrap(name: str, roots: tuple[str, ...]) -> None:  # calls CPython does not audit
        real = getattr(os, name)

        def checked(path: Any, *args: Any, **kwargs: Any) -> Any:
            relative = kwargs.get("dir_fd") is not None
            if not busy and (relative or (type(path) is not int and not inside(path, roots))):
                raise PermissionError(f"sandbox blocked os.{name} of {path!r}: outside the scratch dir")
            return real(path, *args, **kwargs)

        setattr(os, name, checked)

    for name in ("stat", "lstat"):
        wrap(name, read_roots)
    for name in ("mkfifo", "mknod"):
        wrap(name, (scratch,))


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
        # dont_inherit: not this file's `from __future__ import annotations`, which would turn
        # the tool's annotations into strings (dataclasses then look the tool up in sys.modules)
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
