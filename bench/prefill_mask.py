"""A verify-shaped prefill with the attention mask made once per forward against once per layer.

    .venv/bin/python -m bench prefill_mask [--dtypes bfloat16 float32] [--rounds 6] [--name prefill_mask]

The engine's folded attention (`server/attention.py`) used to hand SDPA a boolean mask, which
SDPA turns into an additive -inf/0 mask with a `where` on every call: 30 layers, each
converting the same [rows, 1, folded queries, columns] mask. `folded_mask` now makes it once
per forward. This times one engine's prefill in process (the engine's worker idle, under
`torch.inference_mode` as the worker runs it) at a verify step's shape: 8 rows whose cached
prefixes are 900 to 2,200 tokens, each adding 170 to 205 new ones. The two arms alternate
round by round (the order flipping), each round with new tokens so no arm reuses the other's
cached prompt. Reports the median seconds per prefill of each arm and their ratio.

Writes bench/results/<name>.json.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from bench.harness import MODELS, option, write_result

PREFIXES = (900, 1200, 1400, 1500, 1600, 1800, 2000, 2200)
VOCAB = 40_000


@dataclass
class Options:
    dtypes: list[str] = option(["bfloat16", "float32"], "the engine's number format, one run each")
    rounds: int = option(6, "prefills per arm")
    name: str = option("prefill_mask", "results file name under bench/results")


def boolean_mask(mask: Any, batch: int, groups: int, q_len: int, _: Any) -> Any:
    """The mask as the engine gave it before: boolean, repeated per group (SDPA converts it)."""
    from ratchet.server.attention import repeat_per_group

    return repeat_per_group(mask, batch, groups, q_len)


def measure(dtype: str, rounds: int) -> dict[str, Any]:
    import torch

    from ratchet.server import attention
    from ratchet.server.engine import Engine, GenRequest

    engine = Engine(MODELS / "smollm2-135m-instruct", dtype=getattr(torch, dtype))
    try:
        rng = random.Random(0)
        prefixes = [[rng.randrange(100, VOCAB) for _ in range(n)] for n in PREFIXES]
        for p in prefixes:  # cached, as an agent's history is
            engine.generate(GenRequest(prompt_ids=p, max_tokens=1, temperature=0))

        @torch.inference_mode()
        def prefill(seed: int) -> float:
            r = random.Random(seed)
            prompts = [
                p + [r.randrange(100, VOCAB) for _ in range(170 + 5 * i)] for i, p in enumerate(prefixes)
            ]
            hits = [engine.prefix_cache.lookup(None, p) for p in prompts]
            for _, slots in hits:
                if slots is not None:
                    engine.pool.hold(slots)
            started = time.perf_counter()
            slots, *_ = engine._prefill(prompts, hits, None)
            seconds = time.perf_counter() - started
            engine.pool.release(slots)
            return seconds

        arms = {"once per forward": attention.folded_mask, "per layer (before)": boolean_mask}
        names = list(arms)
        seconds: dict[str, list[float]] = {n: [] for n in names}
        prefill(1)  # warm-up
        try:
            for r in range(rounds):
                for i, n in enumerate(names if r % 2 == 0 else names[::-1]):
                    attention.folded_mask = arms[n]
                    seconds[n].append(prefill(100 + 2 * r + i))
        finally:
            attention.folded_mask = arms["once per forward"]
    finally:
        engine.close()
    medians = {n: statistics.median(v) for n, v in seconds.items()}
    ratio = medians["per layer (before)"] / medians["once per forward"]
    print(f"{dtype}: " + ", ".join(f"{n} {m:.2f} s" for n, m in medians.items()) + f"; {ratio:.2f}x")
    return {"seconds": seconds, "median_seconds": medians, "speedup": round(ratio, 3)}


def run(args: Options) -> None:
    write_result(
        args.name, {"prefixes": PREFIXES, "dtypes": {d: measure(d, args.rounds) for d in args.dtypes}}, args
    )
