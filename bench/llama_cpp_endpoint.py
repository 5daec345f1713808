"""`ratchet evaluate --endpoint` pointed at llama.cpp's own server, next to the embedded server:
what works through a third-party OpenAI-compatible endpoint, and whether the policy plays the
same game on it.

    .venv/bin/python bench/llama_cpp_endpoint.py [--suite textworld-express:coin] [--test 30]

Runs the CLI exactly as a user would (`ratchet --data-dir D [--endpoint URL] evaluate --test N`),
once on the embedded server and once on llama-server (built by bench/llama_cpp.py, 8 slots,
2 threads), one after the other, each in a fresh data dir. Reports per-task outcomes side by
side (greedy: a difference comes from the arithmetic, Q4_1 blocks in llama.cpp against the
same weights dequantized to fp32 in torch), the wall time of each, and a feature check
against llama-server:

* tool calls: does a request with `tools` and `tool_choice="required"` get `tool_calls`
  (ratchet's probe), and does the JSON mode give a valid call at every step;
* JSON schema: `response_format` json_schema with an enum is obeyed;
* seeds: two sampled requests with one seed agree, with another seed they may differ;
* LoRA: ratchet's adapter loading (`POST /v1/load_lora_adapter`, vLLM's request).

Writes bench/results/llama_cpp_endpoint.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.llama_cpp import llama_server  # noqa: E402
from ratchet.server.weights import BASE_MODEL_NAME  # noqa: E402


def evaluate(data: Path, suite: str, test: int, endpoint: str | None) -> tuple[dict[str, bool], float, dict]:
    """Per-task success of `ratchet evaluate`, its wall seconds, and per task the calls it made
    (a step without a tool call is None)."""
    from ratchet.config import load_settings
    from ratchet.memory.trajectory_store import open_store

    cmd = [str(ROOT / ".venv" / "bin" / "ratchet"), "--data-dir", str(data), "--suite", suite]
    if endpoint:
        cmd += ["--endpoint", endpoint]
    cmd += ["evaluate", "--test", str(test)]
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - started
    store = open_store(load_settings({"data_dir": data}).trajectories_db)
    try:
        runs = store.query(split="test")
    finally:
        store.close()
    calls = {
        t.task_id: [s.tool_call.model_dump_json() if s.tool_call else None for s in t.steps] for t in runs
    }
    return {t.task_id: bool(t.success) for t in runs}, wall, calls


def first_difference(a: list, b: list) -> int:
    """The first step where two games differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def side(successes: dict[str, bool], wall: float, calls: dict[str, list]) -> dict[str, object]:
    return {
        "successes": sum(successes.values()),
        "wall_s": round(wall, 1),
        "steps": sum(map(len, calls.values())),
        "steps_without_call": sum(c is None for game in calls.values() for c in game),
    }


def _chat(url: str, **body: object) -> dict:
    r = httpx.post(f"{url}/chat/completions", json={"model": BASE_MODEL_NAME, **body}, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]


def features(url: str) -> dict[str, object]:
    from ratchet.server.launcher import ensure_adapter, probe_tool_calls

    out: dict[str, object] = {}
    out["native_tool_calls"] = probe_tool_calls(url, BASE_MODEL_NAME) == "native"
    colors = ["red", "green", "blue"]
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": colors}},
        "required": ["color"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    replies = [
        _chat(
            url,
            messages=[{"role": "user", "content": f"Name a colour ({i})."}],
            response_format=fmt,
            temperature=1.0,
            seed=i,
            max_tokens=32,
        )["content"]
        for i in range(5)
    ]
    out["json_schema_obeyed"] = all(json.loads(r).get("color") in colors for r in replies)
    story = [{"role": "user", "content": "Tell me a one-line story about a cat."}]
    same = [_chat(url, messages=story, temperature=1.0, seed=7, max_tokens=24)["content"] for _ in range(2)]
    other = [
        _chat(url, messages=story, temperature=1.0, seed=s, max_tokens=24)["content"] for s in (8, 9, 10)
    ]
    out["same_seed_same_reply"] = same[0] == same[1]
    out["other_seeds_differ"] = any(o != same[0] for o in other)
    try:
        ensure_adapter(url, "probe-adapter", ROOT / "no-such-adapter")
        out["lora_runtime_loading"] = "accepted"
    except Exception as exc:  # the error a user sees
        out["lora_runtime_loading"] = f"refused: {exc}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="textworld-express:coin")
    p.add_argument("--test", type=int, default=30)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "llama_cpp_endpoint.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        embedded, embedded_s, embedded_calls = evaluate(root / "embedded", args.suite, args.test, None)
        with llama_server(log=root / "llama-server.log") as url:
            llama, llama_s, llama_calls = evaluate(root / "llamacpp", args.suite, args.test, url)
            checks = features(url)
    both = sorted(embedded)
    firsts = [first_difference(embedded_calls[t], llama_calls.get(t, [])) for t in both]
    summary = {
        "suite": args.suite,
        "tasks": len(both),
        "embedded": side(embedded, embedded_s, embedded_calls),
        "llamacpp": side(llama, llama_s, llama_calls),
        "same_outcome": sum(embedded[t] == llama.get(t) for t in both),
        "same_game": sum(embedded_calls[t] == llama_calls.get(t) for t in both),
        "mean_first_different_step": round(sum(firsts) / len(firsts), 1),
        "embedded_only": [t for t in both if embedded[t] and not llama.get(t)],
        "llamacpp_only": [t for t in both if llama.get(t) and not embedded[t]],
        "llamacpp_features": checks,
    }
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
