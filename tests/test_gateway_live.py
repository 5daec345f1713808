"""The gateway in front of the real embedded model, and decided on by a real `ratchet` process.

* the champion's argument constraint reaches the real server as a schema, and the model's
  constrained call can only name units the question names; streaming works end to end with
  OpenAI's own client;
* the hot swap: eight streams in flight at all times while another process promotes a LoRA
  adapter and then rolls it back (`ratchet adapters promote|rollback`); no request fails, each
  names one version in its header and every chunk, is served by that version's model, and new
  requests carry each new version within seconds;
* `ratchet gateway` itself: one line and exit 2 without a champion, and a real start in front
  of an endpoint that answers and stops on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ratchet.config import Settings, load_settings
from ratchet.gateway.serve import Gateway
from ratchet.gateway.snapshot import POLICY_HEADER
from ratchet.training.registry import AdapterRegistry
from tests.test_gateway import ASK, MODEL, data_dir

RATCHET = str(Path(sys.executable).parent / "ratchet")
QUESTION = {
    "model": "anything",
    "messages": [{"role": "user", "content": "Name a fruit."}],
    "max_tokens": 6,
    "temperature": 0,
    "stream": True,
}


def _env() -> dict[str, str]:
    """A user's shell: none of ratchet's, Prefect's or MLflow's variables of this process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}
    return env | {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "COLUMNS": "200"}


def _ratchet(data: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    argv = [RATCHET, "--data-dir", str(data), *args]
    return subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=timeout)


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


@pytest.mark.integration
def test_the_real_model_is_constrained_by_the_champion_and_streams(
    embedded_server: str, tmp_path: Path
) -> None:
    from openai import OpenAI

    settings = data_dir(tmp_path, timeout_s=600)
    with Gateway(settings, embedded_server) as gw:
        got = httpx.post(f"{gw.url}/chat/completions", json=ASK | {"temperature": 0}, timeout=300)
        assert got.status_code == 200, got.text
        reply = got.json()
        assert got.headers[POLICY_HEADER] == reply["system_fingerprint"] == gw.snapshot.version
        (call,) = reply["choices"][0]["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        words = set(ASK["messages"][-1]["content"].lower().replace("?", "").split())
        # the bound schema reached the server: its grammar lets the model name only the question's words
        assert args["from_unit"].lower() in words and args["to_unit"].lower() in words, args
        client = OpenAI(base_url=gw.url, api_key="anything", max_retries=0, timeout=300)
        raw = client.chat.completions.with_raw_response.create(**QUESTION)
        chunks = list(raw.parse())
    assert chunks and {c.system_fingerprint for c in chunks} == {raw.headers[POLICY_HEADER]}
    assert {c.model for c in chunks} == {MODEL}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()


def _adapter(base_model_dir: Path, where: Path) -> Path:
    """A real LoRA adapter of the shipped model (random, so it answers otherwise than the base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(where)
    return where


class Load:
    """`n` clients, each streaming one request after another until stopped; every answer kept
    as (started, header, fingerprints, models, whole, error)."""

    def __init__(self, url: str, n: int = 8) -> None:
        self.url, self.stop = url, threading.Event()
        self.results: list[dict[str, Any]] = []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(n)]

    def _client(self) -> None:
        with httpx.Client(timeout=300) as c:
            while not self.stop.is_set():
                started = time.monotonic()
                row: dict[str, Any] = {"started": started}
                try:
                    got = c.post(f"{self.url}/chat/completions", json=QUESTION)
                    events = _events(got.text)
                    chunks = [e for e in events if isinstance(e, dict)]
                    row |= {
                        "status": got.status_code,
                        "header": got.headers.get(POLICY_HEADER),
                        "prints": {e.get("system_fingerprint") for e in chunks},
                        "models": {e.get("model") for e in chunks},
                        "whole": bool(events)
                        and events[-1] == "[DONE]"
                        and all("error" not in e for e in chunks),
                    }
                except httpx.HTTPError as exc:
                    row["error"] = repr(exc)
                row["ended"] = time.monotonic()
                self.results.append(row)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def first_under(self, version: str, after: float, within: float) -> float:
        """Seconds from `after` until an answer to a request started after it names `version`."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            done = [r for r in self.results if r.get("header") == version and r["started"] >= after]
            if done:
                return min(r["ended"] for r in done) - after
            time.sleep(0.1)
        raise AssertionError(f"no answer under {version} within {within} s")

    def served(self, version: str, at_least: int, within: float = 300) -> None:
        deadline = time.monotonic() + within
        while sum(r.get("header") == version for r in self.results) < at_least:
            assert time.monotonic() < deadline, f"fewer than {at_least} answers under {version}"
            time.sleep(0.1)


@pytest.mark.integration
@pytest.mark.slow  # over 2 minutes on 2 busy cores; tests/test_gateway.py swaps under load in seconds
def test_hot_swap_under_load_from_another_process_never_mixes_versions(
    embedded_server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    settings = data_dir(tmp_path, timeout_s=600)
    registry = AdapterRegistry(settings)
    v = registry.register(
        _adapter(base_model_dir, tmp_path / "lora"), "", "file:///nowhere", "d", "c", who="test"
    )
    registry.transition(v.name, "verified", who="gate", why="gate passed", evidence={"decision": "accept"})
    data = settings.data_dir
    with Gateway(settings, embedded_server) as gw, Load(gw.url) as load:
        before = gw.snapshot.version
        load.served(before, 8)
        done = _ratchet(data, "adapters", "promote", str(v.version), "--reason", "better", "--by", "test")
        assert done.returncode == 0, done.stderr
        promoted_at = time.monotonic()
        after = gw.snapshot.version
        if after == before:  # not swapped yet: wait for it
            deadline = time.monotonic() + 30
            while gw.snapshot.version == before:
                assert time.monotonic() < deadline, "the promotion never reached the gateway"
                time.sleep(0.05)
            after = gw.snapshot.version
        assert gw.snapshot.policy.served_model == v.served_name
        to_new = load.first_under(after, promoted_at, within=60)
        load.served(after, 8)
        done = _ratchet(data, "adapters", "rollback", "--reason", "worse in use", "--by", "test")
        assert done.returncode == 0, done.stderr
        rolled_at = time.monotonic()
        to_old = load.first_under(before, rolled_at, within=60)
        load.served(before, len([r for r in load.results if r.get("header") == before]) + 8)
    results = load.results
    assert [r for r in results if "error" in r or r["status"] != 200 or not r["whole"]] == []
    for r in results:
        assert r["prints"] == {r["header"]}, r  # every chunk names the version its header names
        served = v.served_name if r["header"] == after else MODEL  # and that version's model made it
        assert r["models"] == {served}, r
    assert {r["header"] for r in results} == {before, after}
    assert to_new < 15 and to_old < 15, (to_new, to_old)
    in_flight = [r for r in results if r["started"] < promoted_at < r["ended"]]
    assert in_flight, "no request was in flight while the promotion was made"


def test_the_command_without_a_champion_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    done = _ratchet(tmp_path / "data", "gateway", "--endpoint", "http://127.0.0.1:9/v1", timeout=300)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "has no champion" in lines[0] and "--allow-base" in lines[0]
    assert not (tmp_path / "data" / "logs" / "server.log").exists()


@pytest.mark.integration
def test_the_command_serves_in_front_of_an_endpoint_and_stops_on_sigterm(
    embedded_server: str, tmp_path: Path
) -> None:
    settings: Settings = data_dir(tmp_path, timeout_s=600)
    port = _free_port()
    argv = [RATCHET, "--data-dir", str(settings.data_dir), "gateway", "--endpoint", embedded_server]
    proc = subprocess.Popen(
        [*argv, "--port", str(port)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway never answered"
            time.sleep(0.5)
        got = httpx.post(f"{url}/chat/completions", json=QUESTION | {"stream": False}, timeout=300)
        assert got.status_code == 200 and got.json()["system_fingerprint"] == got.headers[POLICY_HEADER]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert f"gateway on {url}" in out and got.headers[POLICY_HEADER] in out
    assert "Traceback" not in err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_the_command_starts_and_stops_its_own_model_server(tmp_path: Path) -> None:
    """No --endpoint: the gateway starts the embedded server (listed with the run's services)
    and takes it down with it."""
    from tests.conftest import TEST_MODELS

    settings = load_settings({"data_dir": tmp_path / "data"})
    settings.data_dir.mkdir(parents=True)
    (settings.data_dir / "models").symlink_to(TEST_MODELS, target_is_directory=True)
    port = _free_port()
    argv = [RATCHET, "--data-dir", str(settings.data_dir), "gateway", "--allow-base", "--port", str(port)]
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                got = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=QUESTION | {"stream": False},
                    timeout=300,
                )
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the gateway never answered"
                time.sleep(1)
        assert got.status_code == 200 and "base model" in got.headers["X-Ratchet-Champion"]
        listed = list((settings.data_dir / "run").glob("services-*.json"))
        (server,) = json.loads(listed[0].read_text())["services"]
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert not Path(f"/proc/{server['pid']}").exists() or _zombie(server["pid"])
    assert not list((settings.data_dir / "run").glob("services-*.json"))


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
