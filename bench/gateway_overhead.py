"""What the gateway adds to a model call (p50 and p99, direct and through it), and its memory.

The same agent requests go to the embedded server directly and through `ratchet gateway`, at 1
and 8 in flight. The gateway runs as a user runs it (`ratchet gateway --endpoint URL`, its own
process) in front of the embedded server, serving a champion of one promoted procedure and one
promoted argument constraint (the units example's). Three sides, interleaved in every round and
each first once in three rounds:

* `direct`: the agent's request as it wrote it, to the model server;
* `applied`: the request as the gateway forwards it (the champion's system section, the tool's
  schema bound to the question's words), sent to the model server directly: what the policy
  costs the model, without the gateway;
* `gateway`: the agent's request through the gateway, which records each completion as an
  MLflow trace (its default);
* `unrecorded` (with `--unrecorded`): the same through a second gateway started with
  `--no-record`: `gateway` against it is what recording costs.

`gateway` against `applied` is the gateway's own cost (the hop, reading the body, choosing the
skills, applying the policy, relaying the answer); `applied` against `direct` is what the live
policy makes the model do. Each request is one step of the units example's agent (its system
prompt, the `convert` tool, `tool_choice` required); every side of a round asks the same
questions, each request's system message opened by a tag of the same length that is its own
(`[g00017]`), so the server's prefix cache favours no side and the model does the same work.
The gateway also says its own part of each completion (`Server-Timing: gateway;dur=…`: from
reading the request to the answer, less the upstream's time), which model noise cannot blur:
its p50 and p99 against the whole request's are the overhead's clean measure.

Reports p50 and p99 seconds per side per concurrency (every round's
requests pooled), the median per-round ratio, and the gateway process's resident memory (VmRSS
after the warm-up and at the end, VmHWM).

    .venv/bin/python -m bench gateway_overhead [--requests 48] [--rounds 3]
    .venv/bin/python -m bench gateway_overhead --requests 4 --rounds 1 --name gateway_overhead_quick
    .venv/bin/python -m bench gateway_overhead --unrecorded --rounds 4 --name gateway_recording
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.harness import ROOT, clean_env, embedded_server, fresh_data_dir, option, write_result

EXAMPLE = ROOT / "examples" / "units"
RATCHET = str(Path(sys.executable).parent / "ratchet")


@dataclass
class Options:
    requests: int = option(48, "requests per side, per concurrency, per round")
    rounds: int = option(3, "rounds (3: each side goes first once)")
    concurrency: list[int] = option([1, 8], nargs="*")
    max_tokens: int = option(64, "max_tokens of each request")
    unrecorded: bool = option(False, "a fourth side: a gateway that records no traces (--no-record)")
    name: str = option("gateway_overhead", "results file name under bench/results")


# ------------------------------------------------------------------ shared with gateway_swap


def questions(n: int, offset: int) -> list[str]:
    lines = (EXAMPLE / "tasks.jsonl").read_text().splitlines()
    return [json.loads(lines[(offset + i) % len(lines)])["input"] for i in range(n)]


def agent_request(question: str, max_tokens: int = 64) -> dict[str, Any]:
    """One step of the units example's agent, as it sends it."""
    sys.path.insert(0, str(EXAMPLE))
    from openai_agent import MODEL, SYSTEM, TOOLS  # the example agent's own request

    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def champion(data: Path) -> Any:
    """Settings on `data` whose live policy is a promoted procedure and a promoted argument
    constraint on the example's `convert` tool, decided as a person would."""
    from bench.harness import bench_settings
    from ratchet.skills.format import Skill
    from ratchet.skills.library import SkillLibrary
    from ratchet.types import ArgConstraint, ConstraintSpec

    settings = bench_settings(data, {})
    library = SkillLibrary(settings.skills_dir, settings.index_dir)
    units = {u: ArgConstraint(from_context=True) for u in ("from_unit", "to_unit")}
    common = {"family": "tasks:units", "evolution": "default", "generation": 1, "provenance": ["bench"]}
    for skill in (
        Skill(
            name="units-read-both",
            description="Read both units before converting.",
            body="Name the unit the quantity is in and the unit asked for, as the question writes them.",
            kind="procedure",
            **common,
        ),
        Skill(
            name="units-args",
            description="Units are the question's own.",
            body="Argument constraints.",
            kind="constraint",
            constraint=ConstraintSpec(name="units-args", tools={"convert": units}),
            **common,
        ),
    ):
        library.add(skill)
        library.transition(skill.name, "verified", who="bench", why="given", evidence={"decision": "accept"})
        library.transition(skill.name, "promoted", who="bench", why="the champion under test")
    return settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayProcess:
    """`ratchet gateway --endpoint URL` on a free port, in its own process, as a user runs it."""

    def __init__(
        self, data: Path, upstream: str, log: Path, poll_s: float = 0.5, extra: list[str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        argv = [RATCHET, "--data-dir", str(data), "gateway", "--endpoint", upstream]
        argv += ["--port", str(self.port), "--poll", str(poll_s), *(extra or [])]
        self._log = log.open("w")
        self.proc = subprocess.Popen(argv, env=clean_env(), stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ratchet gateway exited: see {log}")
            try:
                if httpx.get(f"{self.url}/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"ratchet gateway did not answer: see {log}")
            time.sleep(0.5)

    def memory_mb(self) -> dict[str, float]:
        """VmRSS and VmHWM of the gateway process, MB."""
        out = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of `xs` (nearest rank, so p99 of few requests is their slowest)."""
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


# ------------------------------------------------------------------ this benchmark


def side(
    client: httpx.Client,
    url: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    own_ms: list[float] | None = None,
) -> list[float]:
    """Each request's seconds; the gateway's own milliseconds appended to `own_ms` where it says them."""

    def one(body: dict[str, Any]) -> float:
        started = time.perf_counter()
        got = client.post(url, json=body)
        got.raise_for_status()
        took = time.perf_counter() - started
        if own_ms is not None:
            own_ms.append(server_timing(got.headers.get("server-timing", ""))["gateway"])
        return took

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, bodies))


def server_timing(header: str) -> dict[str, float]:
    """`gateway;dur=1.2, upstream;dur=2000` as {"gateway": 1.2, "upstream": 2000.0} (ms)."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


def tagged(body: dict[str, Any], tag: str) -> dict[str, Any]:
    """`body` with its system message opened by `tag`: a prefix no other request shares."""
    messages = [dict(m) for m in body["messages"]]
    messages[0]["content"] = f"[{tag}] {messages[0]['content']}"
    return body | {"messages": messages}


def run(opts: Options) -> None:
    from ratchet.gateway.request import Chooser, forwarded
    from ratchet.gateway.snapshot import POLICY_HEADER

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the bench's own embedding (the `applied` side)
    data = fresh_data_dir("ratchet-gateway-overhead-")
    settings = champion(data)
    sides = ("direct", "applied", "gateway", *(("unrecorded",) if opts.unrecorded else ()))
    gateways = [w for w in sides if w in ("gateway", "unrecorded")]
    rows: list[dict[str, Any]] = []
    seconds: dict[tuple[int, str], list[float]] = {}
    own: dict[tuple[int, str], list[float]] = {}  # a gateway's own ms per completion (Server-Timing)
    with embedded_server(data / "logs") as upstream, httpx.Client(timeout=600) as client:
        gw = GatewayProcess(data, upstream, data / "logs" / "gateway.log")
        plain = (
            GatewayProcess(data, upstream, data / "logs" / "gateway-unrecorded.log", extra=["--no-record"])
            if opts.unrecorded
            else None
        )
        urls = {"gateway": gw.url, "unrecorded": plain.url if plain else ""}
        try:
            from ratchet.flows.runtime import champion_policy
            from ratchet.skills.library import SkillLibrary

            policy = champion_policy(settings, SkillLibrary(settings.skills_dir, settings.index_dir))
            chooser = Chooser(settings.skills)
            probe = client.post(f"{gw.url}/chat/completions", json=agent_request(questions(1, 0)[0], 8))
            assert probe.headers[POLICY_HEADER] == policy.version, "the gateway serves another policy"
            side(client, f"{upstream}/chat/completions", [agent_request(q, 8) for q in questions(8, 0)], 8)
            memory_warm = gw.memory_mb()
            offset = 8
            for r in range(opts.rounds):
                for c in opts.concurrency:
                    asked = questions(opts.requests, offset)
                    offset += opts.requests
                    for which in sides[r % len(sides) :] + sides[: r % len(sides)]:
                        bodies = [
                            tagged(agent_request(q, opts.max_tokens), f"{which[0]}{offset + i:05d}")
                            for i, q in enumerate(asked)
                        ]
                        if which == "applied":
                            bodies = [forwarded(policy, b, chooser) for b in bodies]
                        target = urls.get(which, upstream)
                        took = side(
                            client,
                            f"{target}/chat/completions",
                            bodies,
                            c,
                            own.setdefault((c, which), []) if which in gateways else None,
                        )
                        seconds.setdefault((c, which), []).extend(took)
                        rows.append(
                            {"round": r, "concurrency": c, "side": which, "median_s": statistics.median(took)}
                        )
                        print(json.dumps(rows[-1]), flush=True)
            memory_end = gw.memory_mb()
        finally:
            code = gw.stop()
            if plain is not None:
                plain.stop()
    summary: dict[str, Any] = {}
    for c in opts.concurrency:
        s: dict[str, Any] = {}
        for w in sides:
            s[f"{w}_p50_s"] = statistics.median(seconds[(c, w)])
            s[f"{w}_p99_s"] = quantile(seconds[(c, w)], 0.99)
        per = {w: [x["median_s"] for x in rows if x["concurrency"] == c and x["side"] == w] for w in sides}
        s["gateway_vs_applied_ratio"] = statistics.median(
            g / a for g, a in zip(per["gateway"], per["applied"], strict=True)
        )
        s["applied_vs_direct_ratio"] = statistics.median(
            a / d for a, d in zip(per["applied"], per["direct"], strict=True)
        )
        s["gateway_overhead_p50_ms"] = 1000 * (s["gateway_p50_s"] - s["applied_p50_s"])
        s["gateway_own_p50_ms"] = statistics.median(own[(c, "gateway")])
        s["gateway_own_p99_ms"] = quantile(own[(c, "gateway")], 0.99)
        if opts.unrecorded:  # what recording costs: the same gateway without it, interleaved
            s["unrecorded_own_p50_ms"] = statistics.median(own[(c, "unrecorded")])
            s["unrecorded_own_p99_ms"] = quantile(own[(c, "unrecorded")], 0.99)
            s["recorded_vs_unrecorded_ratio"] = statistics.median(
                g / u for g, u in zip(per["gateway"], per["unrecorded"], strict=True)
            )
        # the gateway's own share of a request at p50 and at p99 (its own p99 against the p99 request's)
        s["own_share_p50"] = s["gateway_own_p50_ms"] / (1000 * s["gateway_p50_s"])
        s["own_share_p99"] = s["gateway_own_p99_ms"] / (1000 * s["gateway_p99_s"])
        summary[str(c)] = s
        print(
            f"{c} in flight: p50 direct {s['direct_p50_s']:.3f} s, applied {s['applied_p50_s']:.3f} s, "
            f"gateway {s['gateway_p50_s']:.3f} s (p99 {s['gateway_p99_s']:.3f} s); "
            f"gateway/applied {s['gateway_vs_applied_ratio']:.3f}; the gateway's own "
            f"{s['gateway_own_p50_ms']:.1f} ms p50 ({100 * s['own_share_p50']:.2f}%), "
            f"{s['gateway_own_p99_ms']:.1f} ms p99 ({100 * s['own_share_p99']:.2f}%)"
        )
        if opts.unrecorded:
            print(
                f"{c} in flight, recording: gateway {s['gateway_p50_s']:.3f} s p50 / "
                f"{s['gateway_p99_s']:.3f} s p99 against unrecorded {s['unrecorded_p50_s']:.3f} / "
                f"{s['unrecorded_p99_s']:.3f} s "
                f"(ratio {s['recorded_vs_unrecorded_ratio']:.3f}); own {s['gateway_own_p50_ms']:.1f} / "
                f"{s['gateway_own_p99_ms']:.1f} ms against {s['unrecorded_own_p50_ms']:.1f} / "
                f"{s['unrecorded_own_p99_ms']:.1f} ms"
            )
    memory = {"warm": memory_warm, "end": memory_end}
    print(f"gateway memory: {memory}")
    result = {"rows": rows, "summary": summary, "gateway_memory_mb": memory, "gateway_exit": code}
    write_result(opts.name, result | {"data": str(data)}, opts)
