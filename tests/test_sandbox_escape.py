"""Break out of the tool sandbox as an attacker would, with nothing but the OS layer in the way.

Every attack runs with `validate=False` (no AST check) and `_INNER_GUARDS = False` (no audit
hook, no import block-list, no os wrappers), so the tool may import os, socket, ctypes and
subprocess freely. Each test runs twice: with the seccomp filter, and without it
(`namespaces-only`: bubblewrap's namespaces and mounts alone). Each asserts that the real
effect did not happen on the host (no file created or changed, no connection or datagram
received, no process killed or left running) and that the attack code really ran (the tool
reports what each attempt did), so a typo cannot make a test pass.

On the sandbox before bubblewrap, even with its inner layers on, the Formatter walk passed
validation and its `dir_fd` write landed in the stdlib (where a `sitecustomize.py` runs at
every later Python start), `mkfifo` made FIFOs in the stdlib, /usr and /, `os.stat` saw every
host path, and the tool ran as root.

attack                                          what stops it (inner layers off)
----------------------------------------------  -------------------------------------------------
Formatter.get_field walk to os, then write      mount ns: host paths are not there (ENOENT);
  a host file and the stdlib                       Python install read-only (EROFS)
dir_fd open/mkdir/rename/symlink/link/mkfifo    read-only bind (EROFS), other mount (EXDEV),
  into the stdlib or a host tmp dir                not mounted (ENOENT); seccomp (mknod: EPERM)
sitecustomize.py, usercustomize.py, .pth        read-only bind of the Python installation
read secrets: host tmp file, /root, /etc,       mount ns: only /usr, the Python install, /dev,
  the project; stat/listdir host paths             /tmp and /scratch exist
ctypes: libc open/mount/unshare/chroot/setuid   mount ns; no capabilities; --disable-userns;
  /system, no_new_privs, capability set            seccomp (mount, unshare, chroot: EPERM)
/proc/self/mem, /proc/1/root, /proc/self/root,  no /proc (nor /sys) in the sandbox
  /proc/sysrq-trigger
symlinks out of scratch, planted by the host    resolved inside the mount ns; the host never
  or by the tool                                   reads the scratch dir after the call
TCP/UDP to a host listener, DNS, abstract       net ns with only its own loopback; seccomp
  unix socket                                      (socket: EPERM)
subprocess/os.system/exec to /bin/sh that       pid + mount ns: the shell runs inside and cannot
  touches a host path                              see the path; seccomp (fork: EPERM)
fork bomb left running, with and without        pid ns: torn down with the call or its timeout;
  a timeout                                        seccomp (fork: EPERM)
kill(host pid), kill(parent), kill(-1)          pid ns
setuid/setgid/setgroups(0)                      user ns: uid 0 unmapped (EINVAL), no capabilities
filling /tmp, /scratch, /dev, /                 tmpfs size caps (ENOSPC); read-only (EROFS)
host environment secrets, host name             --clearenv; uts ns
memory no rlimit counts: 1 GiB in memfds,       seccomp (EPERM); without it RLIMIT_FSIZE x
  memfd_secret, SysV shm/msg/sem, POSIX mq,        RLIMIT_NOFILE bound memfds, RLIMIT_MSGQUEUE
  /dev/shm; 1 GiB anonymous mmaps                  is 0, /dev is read-only, RLIMIT_AS; SysV IPC
                                                   is a known miss without seccomp
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.skills import sandbox
from ratchet.skills.sandbox import MAX_SCRATCH_BYTES, MAX_TMP_BYTES, SANDBOX_UID, run_tool

PROJECT = Path(__file__).resolve().parents[1]
STDLIB = Path(os.__file__).resolve().parent  # the same path inside the sandbox, read-only
SITE_PACKAGES = STDLIB / "site-packages"

# Shared by every attack: run one attempt, report what happened instead of raising.
PRELUDE = '''
import errno, os

def attempt(fn, *args, **kwargs):
    """"ok" (with what it returned, if anything) or the errno name / exception it failed with."""
    try:
        value = fn(*args, **kwargs)
    except OSError as exc:  # socket.gaierror's errno is not an errno: report its type
        return errno.errorcode[exc.errno] if exc.errno in errno.errorcode else type(exc).__name__
    except Exception as exc:
        return type(exc).__name__
    return "ok" if value is None or isinstance(value, int) else ("ok: " + repr(value))[:300]
'''


@pytest.fixture(autouse=True, params=["seccomp", "namespaces-only"])
def layer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Only the OS layer: no AST check (each call passes validate=False), no inner guards."""
    monkeypatch.setattr(sandbox, "_INNER_GUARDS", False)
    monkeypatch.setattr(sandbox, "_SECCOMP", request.param == "seccomp")
    return request.param


def attack(source: str, args: dict[str, Any], **kwargs: Any) -> Any:
    """Run attacker code; it must finish and report, so we know the attempts really ran."""
    result = run_tool(PRELUDE + textwrap.dedent(source), args, validate=False, **kwargs)
    assert result.ok, result.error
    return result.value


def refused(outcomes: dict[str, str], *allowed: str) -> None:
    """Every attempt failed, each with one of the `allowed` errors (when given)."""
    for what, outcome in outcomes.items():
        assert not outcome.startswith("ok"), f"{what}: {outcome}"
        if allowed:
            assert outcome in allowed, f"{what}: {outcome}"


def listing(path: Path) -> set[str]:
    return set(os.listdir(path))


@contextlib.contextmanager
def removing_new(paths: list[str]) -> Iterator[None]:
    """Should an attack get through, remove what it made on the host (after the test has failed)."""
    new = [p for p in paths if not os.path.lexists(p)]
    try:
        yield
    finally:
        for path in new:
            if os.path.lexists(path):
                os.unlink(path)


# ------------------------------------------------------------------ the file system


FORMATTER_WALK = """
import string

def reach_os():
    # No dunder attribute in the code: Formatter.get_field walks the field name instead.
    fmt = string.Formatter()
    subclasses = fmt.get_field("0.__class__.__base__.__subclasses__", [()], {})[0]
    for cls in subclasses():
        try:
            namespace = fmt.get_field("0.__init__.__globals__", [cls], {})[0]
        except AttributeError:
            continue
        if "__builtins__" in namespace:
            builtins = namespace["__builtins__"]
            if not isinstance(builtins, dict):
                builtins = fmt.get_field("0.__dict__", [builtins], {})[0]
            return builtins["__import__"]("os"), fmt

def run(host_file, name):
    walked, fmt = reach_os()
    stdlib = fmt.get_field("0.__file__", [walked], {})[0].rsplit("/", 1)[0]
    out = {"reached os": walked.__name__}
    out["host file"] = attempt(walked.open, host_file, walked.O_WRONLY | walked.O_CREAT)
    fd = walked.open(stdlib, walked.O_RDONLY)  # reading the stdlib dir is fine...
    out["stdlib via dir_fd"] = attempt(walked.open, name, walked.O_WRONLY | walked.O_CREAT, dir_fd=fd)
    out["stdlib by path"] = attempt(walked.open, stdlib + "/" + name, walked.O_WRONLY | walked.O_CREAT)
    return out
"""


def test_formatter_walk_reaches_os_but_cannot_write_outside_the_scratch_dir(tmp_path: Path) -> None:
    host_file, name = tmp_path / "escaped.txt", f"ratchet_escape_{uuid.uuid4().hex}.py"
    try:
        out = attack(FORMATTER_WALK, {"host_file": str(host_file), "name": name})
        assert out.pop("reached os") == "os"  # the walk itself works: only the OS layer stops it
        assert out == {"host file": "ENOENT", "stdlib via dir_fd": "EROFS", "stdlib by path": "EROFS"}
        assert not host_file.exists() and not (STDLIB / name).exists()
    finally:
        (STDLIB / name).unlink(missing_ok=True)


DIR_FD = """
def run(target, name):
    out = {}
    fd = attempt(os.open, target, os.O_RDONLY | os.O_DIRECTORY)
    out["open the dir"] = fd
    open("victim.txt", "w").write("x")
    here = os.open(".", os.O_RDONLY)
    dir_fd = os.open(target, os.O_RDONLY) if fd == "ok" else here  # else: relative to scratch
    prefix = "" if fd == "ok" else target + "/"
    out["os.open"] = attempt(os.open, prefix + name, os.O_WRONLY | os.O_CREAT, dir_fd=dir_fd)
    out["os.mkdir"] = attempt(os.mkdir, prefix + name + ".d", dir_fd=dir_fd)
    out["os.mkfifo"] = attempt(os.mkfifo, prefix + name + ".fifo", dir_fd=dir_fd)
    out["os.symlink"] = attempt(os.symlink, "/scratch", prefix + name + ".ln", dir_fd=dir_fd)
    fds = {"src_dir_fd": here, "dst_dir_fd": dir_fd}
    out["os.link"] = attempt(os.link, "victim.txt", prefix + name + ".hl", **fds)
    out["os.rename"] = attempt(os.rename, "victim.txt", prefix + name + ".mv", **fds)
    out["os.replace"] = attempt(os.replace, "victim.txt", target + "/" + name + ".rp")
    out["os.utime"] = attempt(os.utime, prefix + "os.py" if fd == "ok" else target, dir_fd=dir_fd)
    out["os.chmod"] = attempt(os.chmod, target, 0o777)
    return out
"""


@pytest.mark.parametrize("where", ["stdlib", "host-tmp"])
def test_dir_fd_writes_into_the_stdlib_or_a_host_dir_fail(tmp_path: Path, where: str) -> None:
    target = STDLIB if where == "stdlib" else tmp_path
    name = f"ratchet_escape_{uuid.uuid4().hex}"
    before, mode = listing(target), target.stat().st_mode
    try:
        out = attack(DIR_FD, {"target": str(target), "name": name})
        if where == "stdlib":  # visible, read-only: the kernel refuses every change
            assert out.pop("open the dir") == "ok"
            refused(out, "EROFS", "EXDEV", "EPERM")
        else:  # not in the sandbox at all
            refused(out, "ENOENT", "EPERM")  # EPERM: seccomp refuses mknod before the path
        assert listing(target) == before and target.stat().st_mode == mode
    finally:
        for leftover in listing(target) - before:
            path = target / leftover
            path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()


STARTUP_HOOKS = """
def run(stdlib, site_packages, pth):
    out = {}
    for path in (stdlib + "/sitecustomize.py", stdlib + "/usercustomize.py", site_packages + "/" + pth,
                 stdlib + "/os.py"):
        out[path] = attempt(os.open, path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    fd = os.open(stdlib, os.O_RDONLY)  # the exact trick that beat the audit hook
    out["dir_fd sitecustomize"] = attempt(os.open, "sitecustomize.py", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
    return out
"""


def test_no_code_can_be_planted_for_later_python_starts() -> None:
    pth = f"ratchet_escape_{uuid.uuid4().hex}.pth"
    watched = [STDLIB / "sitecustomize.py", STDLIB / "usercustomize.py", SITE_PACKAGES / pth]
    watched.append(STDLIB / "os.py")
    before = {p: p.read_bytes() if p.exists() else None for p in watched}
    try:
        out = attack(STARTUP_HOOKS, {"stdlib": str(STDLIB), "site_packages": str(SITE_PACKAGES), "pth": pth})
        refused(out, "EROFS")
        assert {p: p.read_bytes() if p.exists() else None for p in watched} == before
    finally:
        for path, content in before.items():
            if content is None:
                path.unlink(missing_ok=True)


MKFIFO = """
def run(paths):
    return {p: attempt(os.mkfifo, p) for p in paths}
"""


def test_mkfifo_outside_the_scratch_dir_fails(tmp_path: Path, layer: str) -> None:
    paths = [str(tmp_path / "fifo"), str(STDLIB / f"ratchet_{uuid.uuid4().hex}")]
    paths += [f"/usr/ratchet-fifo-{uuid.uuid4().hex}", f"/ratchet-fifo-{uuid.uuid4().hex}"]
    with removing_new(paths):
        out = attack(MKFIFO, {"paths": [*paths, "/scratch/fifo"]})
    inside = out.pop("/scratch/fifo")
    assert inside == ("EPERM" if layer == "seccomp" else "ok")  # only the scratch dir is writable
    if layer == "seccomp":
        refused(out, "EPERM")
    else:
        refused(out, "ENOENT", "EROFS")
    assert not any(os.path.lexists(p) for p in paths)


READ_SECRETS = """
def run(paths):
    out = {}
    for path in paths:
        out[path] = attempt(lambda: open(path, "rb").read().decode("utf-8", "replace"))
    return out
"""


def test_host_secrets_are_not_readable(tmp_path: Path) -> None:
    secret = f"hunter2-{uuid.uuid4().hex}"
    (tmp_path / "secret.txt").write_text(secret)
    paths = [
        str(tmp_path / "secret.txt"),
        "/etc/shadow",
        "/etc/passwd",
        "/etc/hostname",
        "/root/.bashrc",
        "/root/.ssh/id_rsa",
        str(PROJECT / "pyproject.toml"),
        str(PROJECT / ".venv" / "pyvenv.cfg"),
        "/proc/1/environ",
        "/run/secrets/token",
    ]
    out = attack(READ_SECRETS, {"paths": paths})
    assert secret not in json.dumps(out)
    refused(out, "ENOENT")


STAT_HOST = """
def run(paths):
    out = {p: attempt(os.stat, p) for p in paths}
    out.update({"listdir " + p: attempt(os.listdir, p) for p in paths})
    return out, sorted(os.listdir("/")), sorted(os.listdir("/root")) if os.path.isdir("/root") else None
"""


def test_host_paths_are_invisible_to_stat_and_listdir(tmp_path: Path) -> None:
    paths = [str(PROJECT), str(tmp_path), "/etc", "/home", "/var", "/run", "/sys", "/proc", "/work", "/opt"]
    out, top, root = attack(STAT_HOST, {"paths": paths})
    refused(out, "ENOENT")
    assert set(top) <= {
        "bin",
        "dev",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "root",
        "sbin",
        "scratch",
        "tmp",
        "usr",
    }
    prefix = Path(os.path.realpath(sys.base_prefix))
    if prefix.is_relative_to("/root"):  # only the way down to the Python installation
        assert root == [prefix.relative_to("/root").parts[0]]
    else:
        assert root is None


CTYPES = """
import ctypes

def run(host_file):
    libc = ctypes.CDLL(None, use_errno=True)

    def c(name, *args):
        result = getattr(libc, name)(*args)
        return "ok" if result >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")

    MS_REMOUNT, MS_BIND, CLONE_NEWUSER, CLONE_NEWNS = 32, 4096, 0x10000000, 0x00020000
    out = {
        "open host file": c("open", host_file.encode(), os.O_WRONLY | os.O_CREAT, 0o644),
        "mount tmpfs": c("mount", b"none", b"/scratch", b"tmpfs", 0, None),
        "remount /usr rw": c("mount", None, b"/usr", None, MS_REMOUNT | MS_BIND, None),
        "unshare user ns": c("unshare", CLONE_NEWUSER),
        "unshare mount ns": c("unshare", CLONE_NEWNS),
        "chroot": c("chroot", b"/tmp"),
        "setuid 0": c("setuid", 0),
    }
    status = libc.system(("touch " + host_file).encode())
    return out, status, libc.prctl(39, 0, 0, 0, 0), libc.prctl(23, 21, 0, 0, 0)  # NO_NEW_PRIVS, SYS_ADMIN
"""


def test_ctypes_calls_into_libc_change_nothing_on_the_host(tmp_path: Path) -> None:
    host_file = tmp_path / "from-ctypes"
    out, status, no_new_privs, cap_sys_admin = attack(CTYPES, {"host_file": str(host_file)})
    refused(out)
    assert out["open host file"] == "ENOENT"
    assert status != 0 and no_new_privs == 1 and cap_sys_admin == 0
    assert not host_file.exists()


PROC = """
def run(host_file):
    return {
        "/proc/self/mem": attempt(lambda: open("/proc/self/mem", "r+b")),
        "/proc/1/root": attempt(os.listdir, "/proc/1/root"),
        "/proc/1/root write": attempt(lambda: open("/proc/1/root" + host_file, "w")),
        "/proc/self/root": attempt(os.stat, "/proc/self/root" + host_file.rsplit("/", 1)[0]),
        "/proc/sysrq-trigger": attempt(os.open, "/proc/sysrq-trigger", os.O_WRONLY),  # opened, never written
        "/proc/self/fd/1": attempt(os.readlink, "/proc/self/fd/1"),
        "/sys/kernel": attempt(os.listdir, "/sys/kernel"),
    }
"""


def test_proc_and_sys_are_not_there(tmp_path: Path) -> None:
    host_file = tmp_path / "via-proc"
    refused(attack(PROC, {"host_file": str(host_file)}), "ENOENT")
    assert not host_file.exists()


FOLLOW_PLANTED = """
def run():
    out = {}
    for link in ("abs", "rel", "dir/secret.txt"):
        out["read " + link] = attempt(lambda: open(link).read())
        out["write " + link] = attempt(lambda: open(link, "a").write("pwned"))
    out["create in dir"] = attempt(lambda: open("dir/new.txt", "w").write("pwned"))
    out["list dir"] = attempt(os.listdir, "dir")
    return out
"""


def test_symlinks_planted_by_the_host_lead_nowhere(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "abs").symlink_to(secret)
    (scratch / "rel").symlink_to("../secret.txt")
    (scratch / "dir").symlink_to(tmp_path)
    before = listing(tmp_path)
    out = attack(FOLLOW_PLANTED, {}, scratch_dir=scratch)
    refused(out, "ENOENT", "EROFS")  # resolved inside: not there, or under the read-only /
    assert secret.read_text() == "hunter2" and listing(tmp_path) == before


PLANT_LINKS = """
def run(target, victim_dir):
    os.symlink(target, "out.txt")  # a result file the host might read or write...
    os.symlink(victim_dir, "cache")  # ...and a dir it might clean up
    os.symlink("/", "root")
    hard_link = attempt(os.link, os.__file__, "os.py")
    return {"hard link to the stdlib": hard_link, "made": sorted(os.listdir("."))}
"""


@pytest.mark.parametrize("scratch_kind", ["tmpfs", "host-dir"])
def test_symlinks_the_tool_plants_are_not_followed_by_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scratch_kind: str
) -> None:
    target, victim = tmp_path / "target.txt", tmp_path / "victim"
    target.write_text("original")
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temp))  # where a host-side scratch dir would go
    scratch = tmp_path / "scratch" if scratch_kind == "host-dir" else None
    out = attack(PLANT_LINKS, {"target": str(target), "victim_dir": str(victim)}, scratch_dir=scratch)
    assert out == {"hard link to the stdlib": "EXDEV", "made": ["cache", "out.txt", "root"]}
    assert target.read_text() == "original" and (victim / "keep.txt").read_text() == "keep"
    assert listing(temp) == set()  # the default scratch dir never touches the host
    if scratch is not None:  # the links are still there, as links: nothing followed them
        assert all((scratch / name).is_symlink() for name in ("out.txt", "cache", "root"))


# ------------------------------------------------------------------ the network


@pytest.fixture
def listeners() -> Any:
    """A TCP server on all addresses, a UDP socket and an abstract unix socket on the host;
    afterwards, assert that nothing reached any of them."""
    tcp = socket.create_server(("0.0.0.0", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0ratchet-escape-{uuid.uuid4().hex}"
    abstract.bind(name)
    abstract.listen()
    with tcp, udp, abstract:
        yield {"tcp": tcp.getsockname()[1], "udp": udp.getsockname()[1], "abstract": name}
        for server in (tcp, udp, abstract):
            server.settimeout(0.1)
        with pytest.raises(TimeoutError):
            tcp.accept()
        with pytest.raises(TimeoutError):
            udp.recv(100)
        with pytest.raises(TimeoutError):
            abstract.accept()


def _host_addresses() -> list[str]:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return sorted({i[4][0] for i in infos} - {"127.0.0.1"})


NETWORK = """
import socket

def run(tcp, udp, abstract, addresses):
    out = {}
    for address in ["127.0.0.1", *addresses]:
        out["tcp " + address] = attempt(socket.create_connection, (address, tcp), timeout=1)
    def send_udp():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"escaped", ("127.0.0.1", udp))
            s.sendto(b"escaped", ("8.8.8.8", 53))
    out["udp"] = attempt(send_udp)
    out["dns"] = attempt(socket.getaddrinfo, "example.com", 80)
    def connect_abstract():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(abstract)
    out["abstract unix"] = attempt(connect_abstract)
    return out
"""


def test_no_network_reaches_the_host(listeners: dict[str, Any], layer: str) -> None:
    out = attack(NETWORK, {**listeners, "addresses": _host_addresses()})
    assert out.pop("dns") == "gaierror"
    if layer == "seccomp":
        refused(out, "EPERM")
    else:  # a network namespace of its own: loopback only, nobody listening there
        refused(out, "ECONNREFUSED", "ENETUNREACH")


# ------------------------------------------------------------------ processes


SHELL = """
import subprocess

def run(host_file):
    out = {
        "subprocess": attempt(subprocess.run, ["sh", "-c", f"echo ran > /scratch/ran; touch {host_file}"]),
        "os.fork": attempt(lambda: os.fork() or os._exit(0)),
    }
    return out, os.system(f"echo ran > /scratch/ran2; touch {host_file}")
"""


def test_a_shell_the_tool_starts_is_still_inside(tmp_path: Path, layer: str) -> None:
    host_file, scratch = tmp_path / "from-the-shell", tmp_path / "scratch"
    out, system_status = attack(SHELL, {"host_file": str(host_file)}, scratch_dir=scratch)
    assert system_status != 0
    if layer == "seccomp":
        refused(out, "EPERM")
        assert listing(scratch) == set()
    else:  # the shell ran (it wrote into the scratch dir) but could not see the host file's dir
        assert out["subprocess"].startswith("ok") and out["os.fork"] == "ok"
        assert listing(scratch) == {"ran", "ran2"}
    assert not host_file.exists()


def test_exec_of_a_shell_is_still_inside(tmp_path: Path) -> None:
    host_file, scratch = tmp_path / "from-exec", tmp_path / "scratch"
    source = (
        "import os\ndef run(host_file):\n"
        "    os.execv('/bin/sh', ['sh', '-c', f'echo ran > /scratch/ran; exec touch {host_file}'])\n"
    )
    result = run_tool(source, {"host_file": str(host_file)}, scratch_dir=scratch, validate=False)
    assert not result.ok and "cannot touch" in result.error  # execve is allowed; the shell ran, inside
    assert (scratch / "ran").exists() and not host_file.exists()


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


FORK_BOMB = """
import time

def run(marker, spin):
    me = os.getpid()
    try:
        for _ in range(5):  # 2**5 processes, each then sleeps for 5 minutes under the marker
            os.fork()
    except OSError as exc:
        if os.getpid() == me:
            return errno.errorcode[exc.errno]
        os._exit(0)
    if os.getpid() != me:
        os.execv("/usr/bin/sleep", [marker, "300"])
    time.sleep(0.3)
    while spin:
        pass
    return "forked"
"""


@pytest.mark.parametrize("ending", ["returns", "times-out"])
def test_processes_the_tool_leaves_behind_die_with_the_call(layer: str, ending: str) -> None:
    marker = f"ratchet-bomb-{uuid.uuid4().hex}"
    args = {"marker": marker, "spin": ending == "times-out"}
    results: list[Any] = []
    call = threading.Thread(
        target=lambda: results.append(run_tool(PRELUDE + FORK_BOMB, args, validate=False, timeout_s=1.5))
    )
    call.start()
    seen = 0
    while call.is_alive():
        seen = max(seen, len(_processes_with(marker)))
        time.sleep(0.05)
    call.join()
    (result,) = results
    if layer == "seccomp":
        assert result.value == "EPERM" and seen == 0
    else:
        assert seen > 0  # the bomb went off, and the check can see it
        assert result.value == "forked" if ending == "returns" else result.error.startswith("tool timed out")
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []


KILL = """
import signal

def run(host_pid):
    return {
        "host pid": attempt(os.kill, host_pid, signal.SIGKILL),
        "parent": attempt(os.kill, os.getppid(), signal.SIGKILL),
        "everyone": attempt(os.kill, -1, signal.SIGKILL),
        "parent pid inside": os.getppid(),
    }
"""


def test_signals_cannot_reach_host_processes() -> None:
    victim = subprocess.Popen(["sleep", "30"])
    try:
        out = attack(KILL, {"host_pid": victim.pid})
        assert out["parent pid inside"] == 1  # bubblewrap's init, in the sandbox's pid namespace
        assert out["host pid"] == "ESRCH"
        time.sleep(0.1)
        assert victim.poll() is None  # still alive, and so are we
    finally:
        victim.kill()
        victim.wait()


SETUID = """
def run():
    out = {
        "setuid": attempt(os.setuid, 0),
        "setgid": attempt(os.setgid, 0),
        "seteuid": attempt(os.seteuid, 0),
        "setresuid": attempt(os.setresuid, 0, 0, 0),
        "setgroups": attempt(os.setgroups, [0]),
    }
    return out, [os.getuid(), os.geteuid(), os.getgid()]
"""


def test_setuid_to_root_fails() -> None:
    out, ids = attack(SETUID, {})
    refused(out, "EINVAL", "EPERM")  # EINVAL: uid 0 does not even exist in the user namespace
    assert ids == [SANDBOX_UID] * 3


# ------------------------------------------------------------------ resources and environment


FILL = """
def fill(directory):
    written = 0
    for i in range(200):  # 1 MiB at a time, a new file every 8 MiB (RLIMIT_FSIZE is 16 MiB)
        try:
            with open(f"{directory}fill{i // 8}", "ab") as f:
                f.write(b"x" * 2**20)
        except OSError as exc:
            return written, errno.errorcode[exc.errno]
        written += 2**20
    return written, "no limit"

def run(prefix):
    return {d: fill(d + "/" + prefix) for d in ("/tmp", "/scratch", "/dev/shm", "/dev", "/usr", "/")}
"""


def test_writable_places_are_small_and_everything_else_is_read_only() -> None:
    prefix = f"ratchet-fill-{uuid.uuid4().hex}-"
    with removing_new([f"{d}/{prefix}fill{i}" for d in ("/tmp", "/dev/shm", "/usr", "") for i in range(25)]):
        out = attack(FILL, {"prefix": prefix}, timeout_s=20)
    for directory, cap in (("/tmp", MAX_TMP_BYTES), ("/scratch", MAX_SCRATCH_BYTES)):
        written, stopped = out[directory]
        assert cap - 2 * 2**20 <= written <= cap and stopped == "ENOSPC"
    for directory in ("/dev/shm", "/dev", "/usr", "/"):
        assert out[directory] == [0, "EROFS"]


ENVIRONMENT = """
def run():
    return dict(os.environ), os.uname().nodename
"""


def test_the_environment_holds_no_host_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATCHET_TEST_SECRET", "s3cret")
    env, hostname = attack(ENVIRONMENT, {})
    assert set(env) <= {"PATH", "LANG", "PWD"} and "s3cret" not in json.dumps(env)
    assert hostname == "sandbox"


WRITE_SCRATCH = """
def run():
    with open("out.txt", "w") as f:
        f.write("result")
    os.mkdir("sub")
    return sorted(os.listdir(".")), open("out.txt").read(), os.getcwd()
"""


@pytest.mark.parametrize("scratch_kind", ["tmpfs", "host-dir"])
def test_the_scratch_dir_still_works(tmp_path: Path, scratch_kind: str) -> None:
    scratch = tmp_path / "scratch" if scratch_kind == "host-dir" else None
    assert attack(WRITE_SCRATCH, {}, scratch_dir=scratch) == [["out.txt", "sub"], "result", "/scratch"]
    if scratch is not None:
        assert (scratch / "out.txt").read_text() == "result"


def test_the_sandbox_process_cannot_signal_the_test_process() -> None:
    # A separate, blunt check of the one host process that matters most: this one.
    source = "import os, signal\ndef run(pid):\n    os.kill(pid, signal.SIGTERM)\n"
    handler = signal.signal(signal.SIGTERM, lambda *_: pytest.fail("the tool signalled the host"))
    try:
        result = run_tool(source, {"pid": os.getpid()}, validate=False)
        assert not result.ok and "ProcessLookupError" in result.error
    finally:
        signal.signal(signal.SIGTERM, handler)


# ------------------------------------------------------------------ memory outside the address space


MEMORY = """
import ctypes, mmap

libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]

def c(result):
    return "ok" if result >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")

def memfds(total):
    # Pages in a memfd are mapped nowhere: outside RLIMIT_AS, every tmpfs cap and the audit hook.
    out = {"ftruncate 1 GiB": "not tried"}
    fds, held, chunk = [], 0, b"x" * 2**20
    try:
        big = os.memfd_create("big")
        out["ftruncate 1 GiB"] = attempt(os.ftruncate, big, 2**30)
        os.close(big)
        while held < total:
            fds.append(os.memfd_create("chunk"))
            for _ in range(16):  # RLIMIT_FSIZE stops a single memfd at 16 MiB
                os.write(fds[-1], chunk)
                held += 2**20
    except OSError as exc:
        out["stopped"] = errno.errorcode[exc.errno]
    out["held"] = held
    for fd in fds:
        os.close(fd)
    return out

def sysv_shm(size, count):
    # A detached segment stays in the IPC namespace, outside the address space.
    for _ in range(count):
        shmid = libc.shmget(0, size, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        if shmid < 0:
            return c(shmid)
        address = libc.shmat(shmid, None, 0)
        ctypes.memset(address, 1, size)
        libc.shmdt(address)
    return "ok"

def run(total, shm_size, shm_count):
    import _posixshmem
    return {
        "memfd": memfds(total),
        "memfd_secret": c(libc.syscall(447, 0)),
        "mmap 1 GiB": attempt(mmap.mmap, -1, 2**30),
        "mmap shared 1 GiB": attempt(mmap.mmap, -1, 2**30, mmap.MAP_SHARED),
        "shm_open": attempt(_posixshmem.shm_open, "/ratchet-shm", os.O_CREAT | os.O_RDWR, 0o600),
        "mq_open": c(libc.mq_open(b"/ratchet-mq", os.O_CREAT | os.O_RDWR, 0o600, None)),
        "msgget": c(libc.msgget(0, 0o1600)),
        "semget": c(libc.semget(0, 1000, 0o1600)),
        "shmget": sysv_shm(shm_size, shm_count),
    }
"""


def test_memory_outside_the_address_space_is_refused_or_bounded(layer: str) -> None:
    # The review's attack allocated ~1 GB per call through memfds. Try 1 GiB every way we know.
    shm = 2**27  # 3 x 128 MiB of detached SysV segments, more than the 256 MB limit
    out = attack(MEMORY, {"total": 2**30, "shm_size": shm, "shm_count": 3}, timeout_s=20)
    assert out["mmap 1 GiB"] == out["mmap shared 1 GiB"] == "ENOMEM"  # RLIMIT_AS, both layers
    assert out["shm_open"] == "EROFS"  # /dev/shm is on the read-only /dev
    if layer == "seccomp":
        assert out["memfd"] == {"ftruncate 1 GiB": "not tried", "stopped": "EPERM", "held": 0}
        ipc = ("memfd_secret", "mq_open", "msgget", "semget", "shmget")
        assert {k: out[k] for k in ipc} == dict.fromkeys(ipc, "EPERM")
    else:  # the rlimits bound it: RLIMIT_FSIZE per memfd, RLIMIT_NOFILE memfds, no message queues
        memfd = out["memfd"]
        assert memfd["ftruncate 1 GiB"] == "EFBIG" and memfd["stopped"] == "EMFILE"
        assert memfd["held"] <= sandbox.MAX_OPEN_FILES * sandbox.MAX_FILE_BYTES
        assert out["mq_open"] == "EMFILE"  # RLIMIT_MSGQUEUE is 0
        # Known misses without seccomp: SysV shared memory, message queues and semaphores live in
        # the IPC namespace, bounded by its (host-default) shmall, msgmni, semmni until the call ends.
        assert out["shmget"] == out["msgget"] == out["semget"] == "ok"
