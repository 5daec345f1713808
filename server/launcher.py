"""Start and stop the embedded server as a child process, and check any endpoint is reachable.

The server's admin routes (loading and unloading adapters, emptying the prefix cache) need
the token of its start (`ratchet.server.app`). `EmbeddedServer` makes one per start, hands it
to the child in `TOKEN_ENV` (the environment: readable by this user only; argv is readable by
every local user) and remembers it for this process's clients (`admin_token`). The server
writes it, 0600, to `DATA_DIR/model-server-PORT.token` (`token_file`) for this user's other
processes: a client that loads an adapter finds it by walking up from the adapter's path,
which the server accepts only inside that data dir anyway.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from types import TracebackType

import httpx

from ratchet import services
from ratchet.errors import EndpointError, PortInUseError
from ratchet.http_guard import LOOPBACK, NotPrivate, read_private_token, write_private_token
from ratchet.server.precision import Precision

READY_TIMEOUT_S = 300.0  # first start converts the GGUF (~20 s quiet, more on a loaded box)
TOKEN_ENV = "RATCHET_SERVER_TOKEN"  # the child's environment only: never set it yourself
_STARTED: dict[str, str] = {}  # http://host:port -> admin token, of the servers this process runs
log = logging.getLogger(__name__)


def token_file(data_dir: Path, port: int) -> Path:
    """Where the server on `port` started for `data_dir` keeps its admin token (mode 0600)."""
    return Path(data_dir) / f"model-server-{port}.token"


def write_token_file(data_dir: Path, port: int, token: str) -> Path | None:
    """Write `token` for this user's other processes (an earlier start's file on the same
    port is replaced); None where the data dir cannot take it (only this process's clients,
    which `admin_token` tells, can then use the admin routes)."""
    path = token_file(data_dir, port)
    try:
        path.unlink(missing_ok=True)
        write_private_token(path, token)
    except OSError as exc:
        log.warning(
            "cannot write %s (%s): only the process that started the server may load adapters", path, exc
        )
        return None
    return path


def remove_token_file(path: Path | None, token: str) -> None:
    """Delete the token file if it still holds `token` (a later start's file stays)."""
    if path is None:
        return
    try:
        if read_private_token(path) == token:
            path.unlink()
    except (OSError, NotPrivate):
        pass


def _root(base_url: str) -> str:
    """'http://127.0.0.1:8000/v1' -> 'http://127.0.0.1:8000'."""
    url = httpx.URL(base_url)
    return f"{url.scheme}://{url.host}:{url.port}"


def admin_token(base_url: str, near: Path | None = None) -> str | None:
    """The admin token of the ratchet server at `base_url`: the one this process started it
    with, else (a loopback server started by another process of this user) the token file of
    the data dir holding `near` (the folder or any folder above it). None: not known."""
    if (token := _STARTED.get(_root(base_url))) is not None:
        return token
    url = httpx.URL(base_url)
    if near is None or url.host.lower() not in LOOPBACK or url.port is None:
        return None
    for folder in (Path(near).resolve(), *Path(near).resolve().parents):
        path = token_file(folder, url.port)
        if path.is_file() or path.is_symlink():
            try:
                return read_private_token(path)
            except NotPrivate:  # planted by someone else, or damaged: never sent anywhere
                continue
    return None


def admin_headers(base_url: str, api_key: str = "x", near: Path | None = None) -> dict[str, str]:
    """The `Authorization` header for an admin route: the ratchet server's token where known,
    else `api_key` (a vLLM server's own key)."""
    return {"Authorization": f"Bearer {admin_token(base_url, near) or api_key}"}


def check_port_free(
    host: str, port: int, fix: str = "set model.port to another port (0 = any free port)"
) -> None:
    """Refuse a taken port in one line; `fix` names the setting or flag that moves this server.

    A port whose last server stopped less than a minute ago still has connections in
    TIME_WAIT: uvicorn binds it anyway (SO_REUSEADDR), so this check does too, and refuses
    only a port something listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if os.name != "nt":  # on Windows the option lets a second listener take the port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise PortInUseError(
                f"port {port} on {host} is already in use", f"stop what is using it, or {fix}"
            ) from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_endpoint(base_url: str, api_key: str = "x", timeout: float = 10.0) -> list[str]:
    """GET {base_url}/models; returns the served model ids or raises one clear EndpointError."""
    try:
        r = httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
    except httpx.HTTPError as exc:
        raise EndpointError(
            f"model endpoint {base_url} is unreachable ({type(exc).__name__})",
            "start the server or fix model.endpoint (empty = use the embedded server)",
        ) from None
    if r.status_code != 200:
        raise EndpointError(
            f"model endpoint {base_url} answered HTTP {r.status_code} to /models",
            "check the URL (it should end in /v1) and the API key",
        )
    try:
        return [m["id"] for m in r.json().get("data", [])]
    except (ValueError, KeyError, TypeError):
        raise EndpointError(
            f"{base_url}/models did not return an OpenAI model list", "is this an OpenAI-compatible API?"
        ) from None


def served_dtype(base_url: str, timeout: float = 10.0) -> str | None:
    """The number format a ratchet server says it computes in (`/health`'s `dtype`), or None
    for a server that does not say (any other OpenAI-compatible endpoint)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.get(f"{root}/health", timeout=timeout)
        dtype = r.json().get("dtype") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    # a format name, or nothing: whatever else a foreign server says never reaches an MLflow param
    return dtype if isinstance(dtype, str) and re.fullmatch(r"[a-z0-9_]{1,32}", dtype) else None


def reset_prefix_cache(base_url: str, timeout: float = 30.0, near: Path | None = None) -> None:
    """Empty a ratchet (or vLLM) server's prefix cache (`POST /reset_prefix_cache`), so that
    replies meant to be compared token for token are each prefilled from the same state.
    `near`: a folder of the server's data dir, where another process started it."""
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = admin_headers(base_url, near=near)
    httpx.post(f"{root}/reset_prefix_cache", json={}, headers=headers, timeout=timeout).raise_for_status()


_PING_TOOL = {
    "type": "function",
    "function": {
        "name": "ping",
        "description": "Reply to the user.",
        "parameters": {"type": "object", "properties": {}},
    },
}


@lru_cache(maxsize=16)
def probe_tool_calls(base_url: str, model: str, api_key: str = "x", timeout: float = 120.0) -> str:
    """'native' if the endpoint answers a request that requires a tool call with `tool_calls`,
    else 'json' (it ignored the tools, or refused them with HTTP 4xx). One short request per
    process and endpoint; unreachable or failing (5xx) raises one clear EndpointError."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Call the ping tool."}],
        "tools": [_PING_TOOL],
        "tool_choice": "required",
        "max_tokens": 32,
        "temperature": 0,
    }
    try:
        r = httpx.post(
            f"{base_url}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        raise EndpointError(
            f"model endpoint {base_url} did not answer a tool-call probe ({type(exc).__name__})",
            "is it up? or set model.tool_calls to 'native' or 'json' to skip the probe",
        ) from None
    if r.status_code >= 500:
        raise EndpointError(
            f"model endpoint {base_url} failed a tool-call probe (HTTP {r.status_code})",
            "check the server's log, or set model.tool_calls to 'native' or 'json'",
        )
    try:
        calls = r.json()["choices"][0]["message"].get("tool_calls") if r.status_code == 200 else None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        calls = None
    return "native" if calls else "json"


def ensure_adapter(base_url: str, name: str, path: Path, api_key: str = "x", timeout: float = 120.0) -> None:
    """Make `name` a served model: load the LoRA adapter at `path` unless it is already served.

    The request is vLLM's (`POST /v1/load_lora_adapter`), which the embedded server speaks too;
    a remote server must be able to read `path` (a shared filesystem)."""
    if name in check_endpoint(base_url, api_key):
        return
    try:
        r = httpx.post(
            f"{base_url}/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(path)},
            headers=admin_headers(base_url, api_key, near=path),  # the server's token, found from the path
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        raise EndpointError(
            f"cannot load adapter {name} into {base_url} ({type(exc).__name__})", "is it up?"
        ) from None
    if r.status_code == 404:  # llama.cpp's llama-server, Ollama, hosted APIs
        raise EndpointError(
            f"{base_url} cannot load LoRA adapters at run time (HTTP 404 on /load_lora_adapter), "
            f"so adapter {name} cannot be served there",
            "serve it yourself (llama.cpp: convert it with convert_lora_to_gguf.py, start llama-server "
            "with --lora and --alias NAME), use a vLLM server, or set finetune.mode = 'export'",
        )
    if r.status_code in (401, 403) and httpx.URL(base_url).host.lower() in LOOPBACK:
        raise EndpointError(
            f"{base_url} refused to load adapter {name}: it takes no admin token this process has "
            f"(HTTP {r.status_code})",
            "load adapters from the process that started the server, or from one whose adapters lie "
            "inside the data dir the server was started for (its model-server-PORT.token is there)",
        )
    if r.status_code != 200:
        detail = r.text[:200].replace("\n", " ")
        raise EndpointError(
            f"{base_url} refused to load adapter {name} from {path} (HTTP {r.status_code}: {detail})",
            "a remote server needs LoRA enabled (vLLM: --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) "
            "and read access to the path; or set finetune.mode = 'export'",
        )


class EmbeddedServer:
    """Context manager: `with EmbeddedServer(models_dir, logs_dir) as base_url: ...`.

    `data_dir`: the only tree the server loads adapters from, and where its token file goes;
    default the log dir's parent (`settings.logs_dir` is DATA_DIR/logs; the models dir may be
    a link to a shared copy of the base model, as the tests' are)."""

    def __init__(
        self,
        models_dir: Path,
        logs_dir: Path,
        port: int = 0,
        max_batch: int = 8,
        host: str = "127.0.0.1",
        dtype: Precision = "auto",
        kv_cache_mb: int | None = None,
        kv_dtype: str = "auto",
        server_args: tuple[str, ...] = (),
        runner: tuple[str, ...] = (),
        stop_timeout_s: float = 15.0,
        stop_signal: signal.Signals = signal.SIGTERM,
        data_dir: Path | None = None,
    ) -> None:
        self.models_dir = models_dir
        self.data_dir = Path(data_dir if data_dir is not None else Path(logs_dir).parent).resolve()
        self.token: str | None = None  # the admin token of the running start
        self.server_args = server_args  # more `python -m ratchet.server` flags (benchmarks' arms)
        # python's arguments before `-m ratchet.server`: a profiler that runs a module
        # (`-m memray run --aggregate -o FILE`; bench/profile_generation.py --memray)
        self.runner = runner
        # how `stop` asks, and how long it waits before SIGKILL. uvicorn raises the signal
        # again once it has shut down: SIGTERM then ends the process without Python's exit
        # handlers, where a profiler writes its capture; SIGINT unwinds through them
        self.stop_signal, self.stop_timeout_s = stop_signal, stop_timeout_s
        self.dtype = dtype
        self.kv_cache_mb = kv_cache_mb  # None: the server's default
        self.kv_dtype = kv_dtype  # the number format of stored keys and values; auto: the server's
        self.logs_dir = logs_dir
        self.host = host
        self.port = port
        self.max_batch = max_batch
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> str:
        if self.port:
            check_port_free(self.host, self.port)
        else:
            self.port = free_port(self.host)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.logs_dir / "server.log"
        env = dict(
            os.environ,
            OMP_NUM_THREADS=os.environ.get("RATCHET_SERVER_THREADS", "2"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        # glibc gives each thread that allocates its own heap; freed tensor memory then stays
        # resident in several. Two heaps: 0.4 GB less resident after 288 agent-like requests
        # (bench/results/server_memory.json)
        env.setdefault("MALLOC_ARENA_MAX", "2")
        if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
            # Idle OpenMP threads sleep instead of spinning. On a shared machine a spinning
            # team waits for a descheduled thread at every op: 16x slower with one busy
            # neighbour (bench/server_contention.py). The price on a quiet machine is decode
            # at ~0.7x; a machine that runs nothing else can set GOMP_SPINCOUNT=10000 for
            # it back (bench/results/decode_arith.json), or OMP_WAIT_POLICY=ACTIVE.
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        self.token = secrets.token_urlsafe(32)  # a new one per start: an old one opens nothing
        env[TOKEN_ENV] = self.token  # the environment, never argv: `ps` shows argv to every user
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    *self.runner,
                    "-m",
                    "ratchet.server",
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                    "--models-dir",
                    str(self.models_dir),
                    "--data-dir",
                    str(self.data_dir),
                    "--max-batch",
                    str(self.max_batch),
                    "--dtype",
                    self.dtype,
                    "--parent-pid",
                    str(os.getpid()),
                    *([] if self.kv_cache_mb is None else ["--prefix-cache-mb", str(self.kv_cache_mb)]),
                    *([] if self.kv_dtype == "auto" else ["--kv-dtype", self.kv_dtype]),
                    *self.server_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        services.register("the embedded model server", self.proc.pid)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                last = _last_line(log_path)
                self.proc = None
                raise EndpointError(f"embedded model server exited at start: {last}", f"see {log_path}")
            try:
                if httpx.get(f"http://{self.host}:{self.port}/health", timeout=2).status_code == 200:
                    _STARTED[_root(self.base_url)] = self.token
                    return self.base_url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise EndpointError(
            f"embedded model server not ready after {READY_TIMEOUT_S:.0f} s", f"see {log_path}"
        )

    def stop(self) -> None:
        if self.token is not None:
            _STARTED.pop(_root(self.base_url), None)
            remove_token_file(token_file(self.data_dir, self.port), self.token)  # if it outlived a kill
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, self.stop_signal)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        services.unregister(self.proc.pid)
        self.proc = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"
