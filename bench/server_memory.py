"""Resident memory of the embedded server under agent-like load, and its throughput beside it.

Agent rollouts send prompts that grow turn by turn: a fixed system prompt, then each turn
adds an observation and the model's short reply, so every prompt extends the one before
and the prefix cache reuses its keys and values. This plays `--sessions` such games of
`--turns` turns each, 8 at a time, against a fresh `python -m ratchet.server` per
configuration, samples the server's resident memory (VmRSS) twice a second (`peak_mb`),
reads the kernel's high-water mark at the end (`hwm_mb`: no spike between samples missed),
and reads it once more after `--idle` seconds without requests. Replies are free text of up to
12 tokens (decode-heavy), or with `--constrained` one of six moves as JSON, as ratchet's
actor asks (one prefill and almost no decode: the grammar forces the rest):

* `keep`: freed memory stays mapped (`--keep-freed`, glibc's default);
* `release`: the server as `ratchet` starts it: after half a second idle, freed memory goes
  back to the OS (`server/memory.py`);
* `one-forward`: every prefill in one forward (`--prefill-chunk 0`);
* `chunked`, `chunk-1024`: the server as `ratchet` starts it: prefills in forwards of at most
  1,024 query tokens (`server/engine.py:PREFILL_CHUNK`); `chunk-2048`: twice that;
* `heap-dynamic`: glibc's default heap (its mmap threshold rises to the largest size freed);
* `heap-mmap`: a fixed mmap threshold of `--mmap-mb` (`MALLOC_MMAP_THRESHOLD_`): larger
  allocations get their own mapping, given back to the OS when freed;
* `heap-mmap-thp`: the same, with glibc asking for transparent huge pages
  (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`);
* `cache-512`, `cache-384`, `cache-256`: the key-value pool's budget in MiB (384: the default).
* `kv-float32`: keys and values stored in the model's fp32 (`--kv-dtype float32`); `kv-16`:
  the server as `ratchet` starts it, fp16 under an fp32 model (bf16: its own, both arms alike);
* `exact-shapes`: prefills as wide as their longest row (`--shape-buckets 0`);
* `shape-buckets`: the server as `ratchet` starts it: prefill widths and cached columns padded
  to four sizes per power of two (`server/engine.py:shape_bucket`);
* `before`: the server's modules from another checkout (`--before-dir`, e.g. made with
  `git worktree add /tmp/ratchet-before <rev>`), the rest of ratchet from this one: an A/B of
  two versions of the engine on one machine in one run;
* `now`: the server as `ratchet` starts it from this checkout.

`--configs A B` compares two of them (the summary's ratios are B over A), each with the
pool's default budget (but `cache-512`, `cache-256`) and two heaps (`MALLOC_ARENA_MAX=2`,
as `server/launcher.py` starts the server). Configurations alternate within each round (the
machine is shared: compare within a run). The first result, `server_memory.json`, compared the prefix cache's
old token budget with its byte budget; `server_memory_release.json` keep with release. Arms
that patched code the key-value pool has since replaced (a merge that kept its sources, the
flat prefix cache) are gone: their A/Bs are rerun at their commits, or against `before`.

    .venv/bin/python -m bench server_memory [--configs one-forward chunked] [--dtypes bfloat16 float32]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench._agent_load import observation, system_prompt
from bench.harness import ROOT, option, write_result
from ratchet.server.memory import resident_mb

CONFIGS = {  # server flags
    "keep": ["--keep-freed"],
    "release": [],
    "one-forward": ["--prefill-chunk", "0"],
    "chunked": [],
    "heap-dynamic": [],
    "heap-mmap": [],
    "heap-mmap-thp": [],
    "cache-512": ["--prefix-cache-mb", "512"],
    "cache-384": [],
    "cache-256": ["--prefix-cache-mb", "256"],
    "before": [],
    "now": [],
    "exact-shapes": ["--shape-buckets", "0"],
    "shape-buckets": [],
    "chunk-2048": ["--prefill-chunk", "2048"],
    "chunk-1024": [],
    "kv-float32": ["--kv-dtype", "float32"],
    "kv-16": [],
}
ENVS = {  # extra environment for an arm's server (`{mmap}`: `--mmap-mb` in bytes)
    # glibc serves allocations of at least this many bytes with their own mapping, given back
    # on free, instead of raising the threshold to each freed size and reusing heap holes
    "heap-mmap": {"MALLOC_MMAP_THRESHOLD_": "{mmap}"},
    # the same, with the kernel's transparent huge pages asked for (madvise): a fresh mapping
    # faults in 2 MiB at a time instead of 4 KiB
    "heap-mmap-thp": {"MALLOC_MMAP_THRESHOLD_": "{mmap}", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}
PRELUDES = {  # run in the server process before `ratchet.server`: arms the server has no flag for
    # `ratchet.server`'s submodules are imported from the other checkout's `server/`
    "before": "import ratchet.server as s; s.__path__[:] = [{before!r}]",
}
SERVER_STATS = ("kv_pool_mb", "prefix_cache_evictions", "prompt_tokens", "prefilled_tokens")
ACT = {  # a constrained reply: the shape of ratchet's actor's step (`--constrained`)
    "type": "object",
    "properties": {
        "action": {"enum": ["move north", "move south", "move east", "move west", "take coin", "look"]}
    },
    "required": ["action"],
}


@dataclass
class Options:
    configs: list[str] = option(["one-forward", "chunked"], help=f"two of {', '.join(CONFIGS)}")
    dtypes: list[str] = option(["bfloat16", "float32"], help="number formats to serve in")
    sessions: int = option(24, help="games played (8 at a time)")
    turns: int = option(12, help="turns per game: each prompt extends the one before")
    rounds: int = option(1, help="keep/release pairs per number format")
    idle: float = option(3.0, help="seconds without requests before the last reading")
    mmap_mb: float = option(1.0, help="heap-mmap: glibc's fixed mmap threshold, MiB")
    before_dir: str = option("", help="before: a checkout of ratchet to take the server's modules from")
    constrained: bool = option(False, help="replies constrained to an action, as ratchet's actor asks")
    models_dir: Path = option(ROOT / ".ratchet" / "test-models")
    port: int = option(8917)
    out: str = option("server_memory_chunked", help="result name under bench/results/")


def rss_mb(pid: int) -> int:
    return resident_mb(pid).get("rss_mb", 0)


def play(opts: Options, dtype: str, config: str) -> dict[str, Any]:
    start = ["-m", "ratchet.server"]
    if config in PRELUDES:
        prelude = PRELUDES[config].format(before=str(Path(opts.before_dir).resolve() / "server"))
        start = ["-c", f"{prelude}; import runpy; runpy.run_module('ratchet.server', run_name='__main__')"]
    args = [sys.executable, *start, "--port", str(opts.port)]
    args += ["--models-dir", str(opts.models_dir), "--dtype", dtype]
    args += CONFIGS[config]
    env = dict(os.environ, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    env["MALLOC_ARENA_MAX"] = "2"
    env.update({k: v.format(mmap=int(opts.mmap_mb * 2**20)) for k, v in ENVS.get(config, {}).items()})
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{opts.port}/v1"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}) before answering")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        loaded = rss_mb(proc.pid)
        model = httpx.get(f"{url}/models", timeout=5).json()["data"][0]["id"]
        system = system_prompt()
        peak, done = [loaded], threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_mb(proc.pid))
                time.sleep(0.5)

        def game(i: int) -> None:
            rng = random.Random(i)
            messages = [{"role": "system", "content": system}]
            for t in range(opts.turns):
                messages.append({"role": "user", "content": observation(rng, t, i)})
                body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
                if opts.constrained:  # one of the moves, as a JSON object: mostly prefill, little decode
                    schema = {"name": "act", "schema": ACT}
                    body["response_format"] = {"type": "json_schema", "json_schema": schema}
                reply = httpx.post(f"{url}/chat/completions", json=body, timeout=1800)
                reply.raise_for_status()
                messages.append(
                    {
                        "role": "assistant",
                        "content": reply.json()["choices"][0]["message"]["content"] or "look",
                    }
                )

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(game, range(opts.sessions)))
        wall = time.perf_counter() - started
        done.set()
        watcher.join()
        end = rss_mb(proc.pid)
        hwm = resident_mb(proc.pid).get("peak_rss_mb", 0)  # the kernel's high-water mark: no sample missed
        health = httpx.get(f"http://127.0.0.1:{opts.port}/health", timeout=30).json()
        time.sleep(opts.idle)
        return {
            # the server's own account: how large its key-value pool ended, what the prefix cache
            # gave back, and how much of the prompts it did not have to prefill
            **{k: health.get(k) for k in SERVER_STATS},
            "loaded_mb": loaded,
            "peak_mb": peak[0],
            "hwm_mb": hwm,
            "end_mb": end,
            "idle_mb": rss_mb(proc.pid),
            "wall_s": round(wall, 1),
            "requests_per_s": round(opts.sessions * opts.turns / wall, 3),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run(opts: Options) -> None:
    if len(opts.configs) != 2 or not set(opts.configs) <= set(CONFIGS):
        raise SystemExit(f"--configs takes two of {', '.join(CONFIGS)}")
    if "before" in opts.configs and not (Path(opts.before_dir) / "server" / "engine.py").is_file():
        raise SystemExit(
            "the before arm needs --before-dir: a checkout, e.g. git worktree add /tmp/ratchet-before REV"
        )
    a, b = opts.configs
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for dtype in opts.dtypes:
        for r in range(opts.rounds):
            for config in (a, b) if r % 2 == 0 else (b, a):
                result = play(opts, dtype, config)
                print(dtype, config, json.dumps(result), flush=True)
                runs.setdefault(dtype, {}).setdefault(config, []).append(result)
    summary: dict[str, Any] = {}
    for dtype, by in runs.items():
        med = {  # an older engine (the before arm) may not report every server statistic
            c: {k: statistics.median(v) for k in xs[0] if (v := [x[k] for x in xs if x[k] is not None])}
            for c, xs in by.items()
        }
        summary[dtype] = {
            **med,
            f"idle_{b}_over_{a}": round(med[b]["idle_mb"] / med[a]["idle_mb"], 3),
            f"peak_{b}_over_{a}": round(med[b]["peak_mb"] / med[a]["peak_mb"], 3),
            f"throughput_{b}_over_{a}": round(med[b]["requests_per_s"] / med[a]["requests_per_s"], 3),
        }
    write_result(opts.out, {"summary": summary, "runs": runs}, opts)
