"""How often the prefix cache changes a seeded reply: the same request, cold and as a cache hit.

An engine in this process answers one chat prompt, seeded, at temperature 1.0, 24 tokens,
for `--seeds` seeds. Per seed, with the prefix cache emptied first: the request cold, then
the same request twice more (both full hits: every prompt token but the last is cached);
then, emptied again, half the prompt is cached by another request and the same request sent
(a partial hit). A pair differs when any token differs. *last-alone* is a variant measured
beside the engine as it is: every prefill feeds the prompt's last token in a forward of its
own, so a cold request computes its first logits the way a full hit does.

    .venv/bin/python -m bench seeded_replies [--dtypes bfloat16 float32] [--seeds 20]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import ROOT, option, write_result

USER = [{"role": "user", "content": "You are in a room with a door and a coin. What do you do?"}]


@dataclass
class Options:
    dtypes: list[str] = option(["bfloat16", "float32"], help="number formats of the engine")
    variants: list[str] = option(["engine", "last-alone"], help="engine: as it is; last-alone: see above")
    seeds: int = option(20, help="seeds per configuration")
    model_dir: Path = option(ROOT / ".ratchet" / "test-models" / "smollm2-135m-instruct")
    out: str = option("seeded_replies", help="result name under bench/results/")


@contextmanager
def _last_token_alone(on: bool) -> Iterator[None]:
    import ratchet.server.engine as engine

    original = engine.prefill_chunks

    def chunks(rows: int, width: int, budget: int, per_octave: int = 0) -> list[tuple[int, int]]:
        # the last column alone, the rest as the engine would (unbucketed: it is an odd width)
        return [(0, width)] if width <= 1 else [*original(rows, width - 1, budget), (width - 1, width)]

    engine.prefill_chunks = chunks if on else original
    try:
        yield
    finally:
        engine.prefill_chunks = original


def _count(model_dir: Path, dtype: str, seeds: int) -> dict[str, int]:
    import torch

    from ratchet.server.engine import Engine, GenRequest

    engine = Engine(model_dir, dtype=getattr(torch, dtype))
    template = engine.tokenizer.apply_chat_template
    prompt = list(template(USER, add_generation_prompt=True, tokenize=True, return_dict=False))

    def reply(seed: int) -> list[int]:
        req = GenRequest(prompt_ids=prompt, max_tokens=24, temperature=1.0, seed=seed)
        return engine.generate(req).token_ids

    differ = {"cold_vs_hit": 0, "hit_vs_hit": 0, "partial_hit_vs_hit": 0}
    for seed in range(seeds):
        engine.prefix_cache.clear()
        cold, hit, again = reply(seed), reply(seed), reply(seed)
        engine.prefix_cache.clear()
        engine.generate(GenRequest(prompt_ids=prompt[: len(prompt) // 2], max_tokens=1, temperature=0))
        partial = reply(seed)
        differ["cold_vs_hit"] += cold != hit
        differ["hit_vs_hit"] += hit != again
        differ["partial_hit_vs_hit"] += partial != again
    engine.close()
    return differ


def run(opts: Options) -> None:
    rows: list[dict[str, Any]] = []
    for dtype in opts.dtypes:
        for variant in opts.variants:
            with _last_token_alone(variant == "last-alone"):
                differ = _count(opts.model_dir, dtype, opts.seeds)
            rows.append({"dtype": dtype, "variant": variant, "seeds": opts.seeds, "differ": differ})
            print(rows[-1], flush=True)
    write_result(opts.out, {"rows": rows}, opts)
