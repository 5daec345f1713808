"""Your agent as a program of its own (`agent.kind = "command"`): one process per task, in a
session and process group of its own, so it can have its own virtualenv and dependencies
(LangGraph's MCP adapter needs mcp 1.x; ratchet's FastMCP needs 2.x).

The contract (docs/your-agent.md, "Your agent in its own process"):

* environment: ratchet's own, less every `RATCHET_*` variable (its settings, the upstream API
  key among them), plus `OPENAI_BASE_URL` (and `OPENAI_API_BASE`, LangChain's older name) set
  to the rollout's base URL, which holds its key (`…/r/<key>/v1`); `OPENAI_API_KEY` set to a
  placeholder (the endpoint needs none, OpenAI's client wants one, and a real key in ratchet's
  environment never reaches the agent); `RATCHET_MAX_STEPS`, the rollout's step budget; and
  with `agent.mcp`, `RATCHET_MCP_URL`, the rollout's MCP server of distilled tools;
* stdin: the task's input as one JSON value and a newline, then end of file;
* stdout: the answer, as UTF-8 text (surrounding whitespace stripped); logs go to stderr;
* exit status 0: answered. Anything else is the agent's failure, with the end of its stderr
  kept (`STDERR_KEPT`) as the trajectory's error.

What the runner guarantees: the whole process group is killed (SIGKILL) at `agent.timeout_s`,
when stdout passes `MAX_ANSWER` bytes, when the run is stopping (Ctrl-C), and when the agent
exits (a process it left behind in its group could still call the endpoint). At most
`MAX_ANSWER` bytes of stdout and `STDERR_KEPT` of stderr are held, whatever the agent writes.
While it runs, its group is listed with the run's services (`ratchet.services`), so a hard exit
or the next start after a SIGKILL of ratchet stops it.

Not covered: a process that leaves the group (`setsid`, a daemon that double-forks into a new
session) escapes the kill, as it would escape any process-group supervisor; its pipes are read
for `DRAIN_S` more and then left. Contain such an agent with a container or a cgroup. The
agent's memory and CPU are not limited: it is your code, trusted like the in-process kinds.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ratchet import services
from ratchet.shutdown import stopping

MAX_ANSWER = 1 << 20  # stdout past this is no answer: the agent is killed
STDERR_KEPT = 16 << 10  # the end of stderr kept for an error (a traceback ends there)
DRAIN_S = 2.0  # after the agent exited: how long its pipes are read for what is still in them
WAKE_S = 0.5  # how often a wait looks at whether the run is stopping
READ = 1 << 16
# The endpoint reads no API key (the rollout's key is in the base URL's path); OpenAI's client
# needs one to start, and a real key in ratchet's environment must not reach the agent.
PLACEHOLDER_KEY = "not-needed"


class AgentProcessError(Exception):
    """The agent's process ended without an answer; the message says how, with its stderr."""


class AgentTimedOut(AgentProcessError):
    """The agent ran past `agent.timeout_s`; its process group was killed."""


@dataclass(frozen=True)
class Ended:
    """How one run of a command ended."""

    status: int | None  # the exit status (negative: the signal that ended it); None: never reaped
    stdout: bytes  # at most MAX_ANSWER bytes
    stderr: bytes  # its last STDERR_KEPT bytes
    stderr_dropped: int  # bytes of stderr before those
    timed_out: bool = False
    overflowed: bool = False  # stdout passed MAX_ANSWER
    stopped: bool = False  # the run was stopping


def agent_environment(base_url: str, max_steps: int, mcp_url: str | None) -> dict[str, str]:
    """What the agent's process is given: ratchet's environment without ratchet's own
    variables, and the rollout's URLs (its key is in their path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env |= {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_BASE": base_url,
        "OPENAI_API_KEY": PLACEHOLDER_KEY,
        "RATCHET_MAX_STEPS": str(max_steps),
    }
    if mcp_url is not None:
        env["RATCHET_MCP_URL"] = mcp_url
    return env


def stdin_of(task_input: Any) -> bytes:
    """The task's input as the agent reads it on stdin: one JSON value, a newline."""
    return json.dumps(task_input, ensure_ascii=False).encode() + b"\n"


def answer_of(command: Sequence[str], ended: Ended, timeout_s: float) -> str:
    """The agent's answer, or `AgentProcessError` saying why there is none."""
    name = os.path.basename(command[0])
    if ended.timed_out:
        raise AgentTimedOut(
            f"the agent ({name}) did not finish in {timeout_s:g} s (agent.timeout_s): its process "
            f"group was killed{_stderr_note(ended)}"
        )
    if ended.stopped:
        raise AgentProcessError(f"the run is stopping: the agent ({name}) was killed")
    if ended.overflowed:
        raise AgentProcessError(
            f"the agent ({name}) wrote more than {MAX_ANSWER} bytes to stdout, which holds only its "
            f"answer: it was killed (write logs to stderr){_stderr_note(ended)}"
        )
    if ended.status != 0:
        if ended.status is None:
            how = "did not end when killed (stuck in the kernel)"
        elif ended.status < 0:
            how = f"was killed by {_signal_name(-ended.status)}"
        else:
            how = f"exited with status {ended.status}"
        raise AgentProcessError(f"the agent ({name}) {how}{_stderr_note(ended)}")
    try:
        return ended.stdout.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise AgentProcessError(
            f"the agent's answer (its stdout) is not UTF-8: {exc}{_stderr_note(ended)}"
        ) from None


def _stderr_note(ended: Ended) -> str:
    text = ended.stderr.decode("utf-8", errors="replace").rstrip()
    if not text:
        return "; it wrote nothing on stderr"
    cut = f"(its first {ended.stderr_dropped} bytes left out)\n" if ended.stderr_dropped else ""
    return f"; its stderr ended:\n{cut}{text}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_process(
    command: Sequence[str], stdin: bytes, env: Mapping[str, str], timeout_s: float, name: str = "your agent"
) -> Ended:
    """Run `command` in a new session with `stdin`, reading its stdout and stderr within their
    bounds until it exits, `timeout_s` passes, stdout overflows or the run is stopping; then
    kill its process group, whatever else it started in it. `OSError` if it cannot start."""
    proc = subprocess.Popen(
        list(command),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        start_new_session=True,
        close_fds=True,
    )
    services.register(name, proc.pid)
    try:
        return _supervise(proc, stdin, time.monotonic() + timeout_s)
    finally:
        if proc.returncode is None:  # not reaped (an error of ours): its group is still its own
            _kill_group(proc.pid)
            _reap(proc)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:  # stdin with unwritten input: the agent is gone
                    pass
        services.unregister(proc.pid)


def _supervise(proc: subprocess.Popen[bytes], stdin: bytes, deadline: float) -> Ended:
    """The I/O loop of `run_process`, on the calling thread: no thread per pipe, and nothing
    held past its bound. The agent is never reaped before its group is killed, so the group's
    id is never one the kernel has given to another process since."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    dropped = 0
    pending = memoryview(stdin)
    reading = 2  # stdout and stderr, until each is at its end
    sel = selectors.DefaultSelector()
    exited = os.pidfd_open(proc.pid)  # readable once the agent exits (a zombie until reaped)
    try:
        sel.register(exited, selectors.EVENT_READ, "exited")
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
        drain_until: float | None = None  # set once it exited
        while drain_until is None or reading:
            now = time.monotonic()
            if drain_until is None and now >= deadline:
                return _ended(proc, out, err, dropped, timed_out=True)
            if stopping():
                return _ended(proc, out, err, dropped, stopped=True)
            if drain_until is not None and now >= drain_until:
                break  # a process that left the group holds the pipes: keep what came
            until = deadline if drain_until is None else drain_until
            for key, _ in sel.select(min(WAKE_S, max(0.0, until - now))):
                if key.data == "exited":
                    sel.unregister(exited)
                    if pending:
                        sel.unregister(proc.stdin)
                        pending = pending[:0]
                    _kill_group(proc.pid)  # what it left in its group: the pipes close, nothing calls late
                    drain_until = time.monotonic() + DRAIN_S
                elif key.data == "stdin":
                    if pending:  # else: given up in this same batch, when it exited
                        pending = _write_some(sel, proc, pending)
                elif not (chunk := os.read(key.fd, READ)):
                    sel.unregister(key.fileobj)
                    reading -= 1
                elif key.data == "stdout":
                    out += chunk
                    if len(out) > MAX_ANSWER:
                        return _ended(proc, out[:MAX_ANSWER], err, dropped, overflowed=True)
                else:
                    err += chunk
                    if len(err) > STDERR_KEPT:
                        dropped += len(err) - STDERR_KEPT
                        del err[: len(err) - STDERR_KEPT]
        return _ended(proc, out, err, dropped)
    finally:
        sel.close()
        os.close(exited)


def _write_some(
    sel: selectors.BaseSelector, proc: subprocess.Popen[bytes], pending: memoryview
) -> memoryview:
    """As much of the input as the pipe takes now; closed when all is written or the agent
    stopped reading (it may answer without reading its input)."""
    assert proc.stdin is not None
    try:
        pending = pending[os.write(proc.stdin.fileno(), pending) :]
    except BlockingIOError:
        return pending
    except OSError:  # EPIPE: it closed stdin
        pending = pending[:0]
    if not pending:
        sel.unregister(proc.stdin)
        try:
            proc.stdin.close()
        except OSError:
            pass
    return pending


def _ended(proc: subprocess.Popen[bytes], out: bytearray, err: bytearray, dropped: int, **how: bool) -> Ended:
    """The run as it ended: its group killed first (a still-running agent with it), then reaped."""
    _kill_group(proc.pid)
    return Ended(_reap(proc), bytes(out), bytes(err), dropped, **how)


def _reap(proc: subprocess.Popen[bytes]) -> int | None:
    try:
        return proc.wait(timeout=10)  # SIGKILLed: at once, unless stuck in the kernel
    except subprocess.TimeoutExpired:
        return None


def _kill_group(pgid: int) -> None:
    """SIGKILL every process of the agent's group. Safe after the leader exited: a group's id
    is not given to another process while any member of the group lives."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_command(
    command: Sequence[str],
    task_input: Any,
    base_url: str,
    max_steps: int,
    mcp_url: str | None,
    timeout_s: float,
) -> str:
    """Your agent's answer to one task, from its own process; `AgentProcessError` (or
    `AgentTimedOut`) when there is none."""
    env = agent_environment(base_url, max_steps, mcp_url)
    name = f"your agent ({os.path.basename(command[0])})"
    try:
        ended = run_process(command, stdin_of(task_input), env, timeout_s, name)
    except OSError as exc:  # removed or made unexecutable since the settings were read; out of fds
        raise AgentProcessError(f"cannot run the agent's command {command[0]!r}: {exc}") from None
    return answer_of(command, ended, timeout_s)
