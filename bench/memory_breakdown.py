"""What the engine's memory is made of at its peak, by the line that allocated it.

Plays server_memory's agent-like load (`--sessions` games of 12 turns, one shared 500-word
system prompt, 8 at a time) against an engine in this process under memray, then lists the
allocations alive at the heap's high-water mark, summed by their four innermost Python
frames. Resident memory is this plus the libraries' mapped code and data (~0.3 GB of torch)
and whatever freed memory the allocator keeps; the high-water mark of the heap alone says
which of the engine's own structures make the peak. `--before-dir` takes `server/` from
another checkout (as server_memory's `before` arm). `--report FILE.bin` only reads a capture.

Needs memray (`pip install memray`; not one of ratchet's dependencies).

    .venv/bin/python -m bench memory_breakdown [--dtype bfloat16] [--before-dir DIR] [--out NAME]
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import ROOT, option, write_result

LOAD = """
import random, sys, time, json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
if sys.argv[4]:
    import ratchet.server as s
    s.__path__[:] = [sys.argv[4]]
import torch
torch.set_num_threads(2)
from bench._agent_load import observation, system_prompt
from ratchet.server.engine import Engine, GenRequest
from ratchet.server.memory import resident_mb
engine = Engine(Path(sys.argv[1]), dtype=getattr(torch, sys.argv[2]))
tok = engine.tokenizer
system = system_prompt()
def game(i):
    rng = random.Random(i)
    messages = [{"role": "system", "content": system}]
    for t in range(12):
        messages.append({"role": "user", "content": observation(rng, t, i)})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        reply = engine.generate(GenRequest(prompt_ids=list(ids), max_tokens=12, temperature=0))
        messages.append({"role": "assistant", "content": reply.text or "look"})
started = time.perf_counter()
with ThreadPoolExecutor(8) as pool:
    list(pool.map(game, range(int(sys.argv[3]))))
wall = time.perf_counter() - started
print(json.dumps({**resident_mb(), "requests_per_s": round(int(sys.argv[3]) * 12 / wall, 3)}))
engine.close()
"""


@dataclass
class Options:
    dtype: str = option("bfloat16", help="number format of the engine")
    sessions: int = option(16, help="games played (8 at a time)")
    before_dir: str = option("", help="a checkout of ratchet to take the server's modules from")
    report: str = option("", help="only read this memray capture (.bin)")
    top: int = option(12, help="allocation sites listed")
    model_dir: Path = option(ROOT / ".ratchet" / "test-models" / "smollm2-135m-instruct")
    out: str = option("memory_breakdown", help="result name under bench/results/")


def breakdown(capture: Path, top: int) -> dict[str, Any]:
    """The allocations alive at the heap's high-water mark, by their innermost frames, MiB."""
    from memray import FileReader

    reader = FileReader(str(capture))
    by: collections.Counter[str] = collections.Counter()
    for record in reader.get_high_watermark_allocation_records(merge_threads=True):
        stack = record.stack_trace(max_stacks=4)
        site = " <- ".join(f"{fn} {path.split('/')[-1]}:{line}" for fn, path, line in stack)
        by[site or "?"] += record.size
    return {
        "heap_peak_mb": round(reader.metadata.peak_memory / 2**20, 1),
        "sites_mb": {site: round(size / 2**20, 1) for site, size in by.most_common(top)},
    }


def run(opts: Options) -> None:
    try:
        import memray  # noqa: F401
    except ImportError:
        raise SystemExit("memory_breakdown needs memray: .venv/bin/pip install memray") from None
    result: dict[str, Any] = {}
    if opts.report:
        capture = Path(opts.report)
    else:
        capture = Path(tempfile.mkdtemp(prefix="ratchet-memray-")) / "capture.bin"
        before = str(Path(opts.before_dir).resolve() / "server") if opts.before_dir else ""
        env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_ARENA_MAX="2", TOKENIZERS_PARALLELISM="false")
        args = [sys.executable, "-m", "memray", "run", "-o", str(capture), "-c", LOAD]
        args += [str(opts.model_dir), opts.dtype, str(opts.sessions), before]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
        # the load's own line (resident memory, requests/s); memray prints its hints after it
        line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("{"))
        result["process"] = json.loads(line)
    result |= breakdown(capture, opts.top)
    for site, mb in result["sites_mb"].items():
        print(f"{mb:9.1f} MiB  {site}")
    write_result(opts.out, result, opts)
