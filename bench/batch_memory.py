"""Where one batch's memory goes: an engine in this process, one long prefill at a time.

Each configuration runs in a fresh process: the engine is loaded (resident memory after
imports and after loading), then `--rounds` batches of 8 prompts of ~2,000 random tokens
each are answered (a cold prefill: nothing cached); after each, the resident memory, the
peak so far and the prefix cache's bytes are read, then glibc is asked to give freed
memory back and the resident memory read again. What stays after that is what the engine
holds (weights, keys and values); the difference is what a batch held and freed. Compared:
prefills in one forward (chunk 0) or in forwards of at most `--chunks` query tokens
(`server/engine.py:PREFILL_CHUNK`); every configuration also times its batches. (Its first
results also compared KV buffers that grew by half or by an eighth; the engine has had no
such buffers since keys and values moved to one pool, `server/kv_pool.py`.)

    .venv/bin/python -m bench batch_memory [--dtype bfloat16] [--chunks 0 2048]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import ROOT, option, write_result

PROBE = """
import json, random, sys, time, torch
from concurrent.futures import wait
from pathlib import Path
from ratchet.server.engine import Engine, GenRequest
from ratchet.server.memory import release_free_memory, resident_mb
out = {"imported": resident_mb()}
engine = Engine(
    Path(sys.argv[1]), dtype=getattr(torch, sys.argv[2]), release_idle_s=None, prefill_chunk=int(sys.argv[4])
)
out["loaded"] = resident_mb()
rng, rounds = random.Random(0), []
for _ in range(int(sys.argv[3])):
    prompts = [[rng.randrange(100, 40_000) for _ in range(1_800 + 50 * i)] for i in range(8)]
    reqs = [GenRequest(p, 4, temperature=0) for p in prompts]
    started = time.perf_counter()
    wait([engine.submit(r) for r in reqs])
    seconds = round(time.perf_counter() - started, 2)
    row = {**resident_mb(), "prefix_cache_mb": engine.prefix_cache.cached_bytes >> 20, "seconds": seconds}
    release_free_memory()
    rounds.append(row | {"released_rss_mb": resident_mb()["rss_mb"]})
out["rounds"] = rounds
engine.close()
print(json.dumps(out))
"""


@dataclass
class Options:
    dtype: str = option("bfloat16", help="number format of the engine")
    chunks: list[int] = option([0, 2048], help="prefill chunk budgets to compare (query tokens; 0: none)")
    rounds: int = option(3, help="batches per configuration")
    model_dir: Path = option(ROOT / ".ratchet" / "test-models" / "smollm2-135m-instruct")
    out: str = option("batch_memory", help="result name under bench/results/")


def run(opts: Options) -> None:
    runs: dict[str, Any] = {}
    env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_ARENA_MAX="2", TOKENIZERS_PARALLELISM="false")
    for chunk in opts.chunks:
        key = f"chunk {chunk}"
        args = [sys.executable, "-c", PROBE, str(opts.model_dir), opts.dtype, str(opts.rounds), str(chunk)]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
        runs[key] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(key, json.dumps(runs[key]), flush=True)
    summary = {
        key: {
            "peak_rss_mb": max(r["peak_rss_mb"] for r in doc["rounds"]),
            "seconds": [r["seconds"] for r in doc["rounds"]],
        }
        for key, doc in runs.items()
    }
    write_result(opts.out, {"summary": summary, "runs": runs}, opts)
