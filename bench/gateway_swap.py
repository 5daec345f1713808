"""Hot swap under load: a promotion and a rollback from another process while the gateway serves.

`ratchet gateway` serves a steady stream of requests while another process promotes a
candidate and then rolls it back: are answers ever lost or mixed, and how long until the new
version serves?

The gateway runs as a user runs it (its own process, `--endpoint` the embedded server) with
`--clients` clients streaming agent requests back to back. Each decision is made by the real
command in another process (`ratchet adapters promote|rollback`, or `ratchet skills
promote|rollback` with `--kind skill`), `--phase-s` seconds apart. Counted over every request:

* served and errors (a status other than 200, a stream without `[DONE]` or with an error
  event, a connection that failed);
* mixed: a request whose chunks do not all name the version its header names, or whose
  chunks came from another model than that version serves (the adapter by name);
* for each decision, seconds from its audit line (the record's own time) to the new version
  going live in the gateway (`/health`'s `live_since`), and to the first answer under it (its
  headers arriving; the embedded server sends a streamed reply once it is whole, so this adds
  a request's own time);
* latency p50 and p99 of the requests that overlapped a swap, against the rest.

`--kind adapter` (the default) trains nothing: it registers a random LoRA of the shipped model
as a verified version (made with peft, seconds), so the swap includes loading it on the
server. `--kind skill` promotes a procedure.

    .venv/bin/python -m bench gateway_swap [--clients 8] [--phase-s 30]
    .venv/bin/python -m bench gateway_swap --kind skill --clients 2 --phase-s 5 --name gateway_swap_quick
"""

from __future__ import annotations

import json
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.gateway_overhead import RATCHET, GatewayProcess, agent_request, champion, quantile, questions
from bench.harness import MODELS, clean_env, embedded_server, fresh_data_dir, option, write_result


@dataclass
class Options:
    clients: int = option(8, "clients streaming requests back to back")
    phase_s: float = option(30.0, "seconds of load before the promotion, between it and the rollback, after")
    kind: str = option("adapter", "what is promoted and rolled back", choices=["adapter", "skill"])
    max_tokens: int = option(16, "max_tokens of each request")
    poll_s: float = option(0.5, "the gateway's --poll")
    name: str = option("gateway_swap", "results file name under bench/results")


class Load:
    """Clients streaming requests back to back; every request kept with its wall-clock times."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.stop = threading.Event()
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._n = 0
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _next(self) -> str:
        with self._lock:
            self._n += 1
            return questions(1, self._n)[0]

    def _client(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                body = agent_request(self._next(), self.max_tokens) | {"stream": True}
                row: dict[str, Any] = {"started": time.time()}
                try:
                    with client.stream("POST", f"{self.url}/chat/completions", json=body) as got:
                        row["headers_at"] = time.time()
                        row["status"] = got.status_code
                        row["header"] = got.headers.get("x-ratchet-policy")
                        events = [ln[6:] for ln in got.iter_lines() if ln.startswith("data: ")]
                    chunks = [json.loads(e) for e in events if e != "[DONE]"]
                    row["prints"] = sorted({c.get("system_fingerprint") for c in chunks})
                    row["models"] = sorted({c.get("model") for c in chunks})
                    row["whole"] = (
                        bool(events) and events[-1] == "[DONE]" and all("error" not in c for c in chunks)
                    )
                except (httpx.HTTPError, ValueError) as exc:
                    row["error"] = repr(exc)[:300]
                row["ended"] = time.time()
                with self._lock:
                    self.rows.append(row)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=600)


def decide(data: Path, kind: str, action: str, name: str) -> tuple[float, float]:
    """Make the decision with the real command; (seconds it took, its audit line's own time)."""
    args = [kind + "s", action, name] if action == "promote" else [kind + "s", "rollback", name]
    argv = [RATCHET, "--data-dir", str(data), *args, "--reason", "bench", "--by", "bench"]
    if kind == "adapter" and action == "rollback":
        argv = [
            RATCHET,
            "--data-dir",
            str(data),
            "adapters",
            "rollback",
            "--reason",
            "bench",
            "--by",
            "bench",
        ]
    started = time.monotonic()
    done = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {done.stderr.strip()}")
    took = time.monotonic() - started
    audit = data / (kind + "s") / "audit.jsonl"
    last = json.loads(audit.read_text().splitlines()[-1])
    return took, datetime.fromisoformat(last["at"]).timestamp()


def went_live(url: str, was: str, within: float = 120.0) -> float | None:
    """When the version after `was` went live (`/health`'s `live_since`; None: not within)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        health = httpx.get(f"{url.removesuffix('/v1')}/health", timeout=60).json()
        if health["policy"] != was:
            return float(health["live_since"])
        time.sleep(0.05)
    return None


def candidate(settings: Any, kind: str) -> tuple[str, str | None]:
    """A verified candidate of `kind` to promote: its name, and the model it serves (adapter)."""
    if kind == "skill":
        from ratchet.skills.format import Skill
        from ratchet.skills.library import SkillLibrary

        library = SkillLibrary(settings.skills_dir, settings.index_dir)
        skill = Skill(
            name="units-check",
            description="Check the unit of the answer.",
            body="Before answering, check that the answer is in the unit the question asked for.",
            kind="procedure",
            family="tasks:units",
            evolution="default",
            generation=2,
            provenance=["bench"],
        )
        library.add(skill)
        library.transition(skill.name, "verified", who="bench", why="given", evidence={"decision": "accept"})
        return skill.name, None
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ratchet.server.weights import BASE_MODEL_NAME
    from ratchet.training.registry import AdapterRegistry

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(MODELS / BASE_MODEL_NAME, dtype=torch.float32)
    where = settings.data_dir / "bench-lora"
    lora = LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(where)
    del base
    registry = AdapterRegistry(settings)
    v = registry.register(where, "", "file:///bench", "bench", "bench", who="bench")
    registry.transition(v.name, "verified", who="bench", why="given", evidence={"decision": "accept"})
    return str(v.version), v.served_name


def run(opts: Options) -> None:
    data = fresh_data_dir("ratchet-gateway-swap-")
    settings = champion(data)
    name, adapter = candidate(settings, opts.kind)
    decisions: list[dict[str, Any]] = []
    with embedded_server(data / "logs") as upstream:
        gw = GatewayProcess(data, upstream, data / "logs" / "gateway.log", opts.poll_s)
        try:
            with Load(gw.url, opts.clients, opts.max_tokens) as load:
                for action in ("promote", "rollback"):
                    time.sleep(opts.phase_s)
                    was = httpx.get(f"{gw.url.removesuffix('/v1')}/health", timeout=60).json()["policy"]
                    took, line_at = decide(data, opts.kind, action, name)
                    live = went_live(gw.url, was)
                    decisions.append(
                        {"action": action, "command_s": took, "audit_at": line_at, "live_at": live}
                    )
                    print(f"{action} {name}: the command took {took:.1f} s", flush=True)
                time.sleep(opts.phase_s)
            memory = gw.memory_mb()
        finally:
            code = gw.stop()
    rows = load.rows
    result = summarize(rows, decisions, adapter, upstream_model(settings))
    result |= {"decisions": decisions, "gateway_memory_mb": memory, "gateway_exit": code, "data": str(data)}
    print(json.dumps({k: v for k, v in result.items() if k not in ("decisions", "versions")}, indent=1))
    write_result(opts.name, result | {"rows": rows}, opts)


def upstream_model(settings: Any) -> str:
    return str(settings.model.name)


def summarize(
    rows: list[dict[str, Any]], decisions: list[dict[str, Any]], adapter: str | None, base: str
) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r and r.get("status") == 200 and r.get("whole")]
    errors = len(rows) - len(ok)
    versions: list[str] = []  # in the order they served
    for r in sorted(ok, key=lambda r: r["headers_at"]):
        if not versions or versions[-1] != r["header"]:
            versions.append(r["header"])
    # the promoted version serves the adapter by name; the others the base model
    promoted = versions[1] if len(versions) > 1 else None
    mixed = 0
    for r in ok:
        model = adapter if (adapter and r["header"] == promoted) else base
        if r["prints"] != [r["header"]] or r["models"] != [model]:
            mixed += 1
    swaps = []
    for d, new in zip(decisions, versions[1:], strict=False):
        line = d["audit_at"]
        first = min(
            (r["headers_at"] for r in ok if r["header"] == new and r["headers_at"] >= line), default=None
        )
        swaps.append(
            {
                "action": d["action"],
                "version": new,
                "audit_line_to_live_s": None if d["live_at"] is None else d["live_at"] - line,
                "audit_line_to_first_answer_s": None if first is None else first - line,
            }
        )
    windows = [(d["audit_at"], d["audit_at"] + 10) for d in decisions]
    during = [
        r["ended"] - r["started"] for r in ok if any(r["started"] < b and r["ended"] > a for a, b in windows)
    ]
    steady = [
        r["ended"] - r["started"]
        for r in ok
        if not any(r["started"] < b and r["ended"] > a for a, b in windows)
    ]
    latency = {
        name: {"n": len(xs), "p50_s": statistics.median(xs), "p99_s": quantile(xs, 0.99)}
        for name, xs in (("around_swaps", during), ("steady", steady))
        if xs
    }
    return {
        "requests": len(rows),
        "served": len(ok),
        "errors": errors,
        "mixed_version_requests": mixed,
        "versions_in_order": versions,
        "swaps": swaps,
        "latency": latency,
        "base_model": base,
    }
