"""Agent traffic through the embedded engine: grouped-query attention with the query heads
folded onto their key/value head (`server.attention`), against transformers' `sdpa`, which
copies every key and value per query head (`repeat_kv`) in each prefill forward.

The same workload as `bench/prefill_groups.py` (8 coin rollouts at once, each step's exact
prompt and tool grammar, greedy, each reply decoded to its end). The two engines run
interleaved, `--rounds` times each, in one process. The logits are the same to the bit
(`tests/test_engine.py`), so every reply must be the same token for token (asserted).

    .venv/bin/python bench/grouped_attention.py [--rollouts 16] [--steps 15] [--rounds 2]
    .venv/bin/python bench/grouped_attention.py --forward [--past 1500]

`--forward` times one prefill forward instead: 8 rows (holes on the left, as the engine
lays them out) of 48 new tokens over `--past` cached tokens, both attentions interleaved,
`--rounds` times, asserting the same logits to the bit.

Writes bench/results/grouped_attention.json (`--forward`: grouped_attention_forward.json).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _setup import write_result  # noqa: E402
from prefill_groups import medians, run_variants, traffic_parser  # noqa: E402

KEYS = ("seconds", "prefill_seconds", "decode_seconds", "kv_seconds", "prefilled_tokens")


def one_forward(past: int, rounds: int, rows: int = 8, width: int = 48) -> dict[str, object]:
    """Seconds of one masked prefill forward per attention, interleaved, same logits asserted."""
    import copy
    import time

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from ratchet.server import attention
    from ratchet.server.weights import ensure_hf_copy

    model_dir = ensure_hf_copy(ROOT / ".ratchet" / "models")
    impls = {"repeat_kv (sdpa)": "sdpa", "folded": attention.NAME}
    models = {
        name: AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=impl
        ).eval()
        for name, impl in impls.items()
    }
    ids = torch.randint(0, 49000, (rows, past + width), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(rows, past + width, dtype=torch.long)
    for i in range(rows):
        attn[i, : 37 * i] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    seconds: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        caches = {}
        for name, model in models.items():
            caches[name] = DynamicCache()
            model(
                input_ids=ids[:, :past],
                attention_mask=attn[:, :past],
                position_ids=pos[:, :past],
                cache=caches[name],
            )
        for _ in range(rounds):
            logits = []
            for name, model in models.items():
                cache = copy.deepcopy(caches[name])
                started = time.perf_counter()
                out = model(
                    input_ids=ids[:, past:], attention_mask=attn, position_ids=pos[:, past:], cache=cache
                )
                seconds[name].append(time.perf_counter() - started)
                logits.append(out.logits)
                print(f"{name:16s} {seconds[name][-1]:.3f} s", flush=True)
            assert torch.equal(logits[0], logits[1]), "the attentions gave different logits"
    med = {name: statistics.median(v) for name, v in seconds.items()}
    return {
        "rows": rows,
        "width": width,
        "past": past,
        "seconds": seconds,
        "median": med,
        "speedup": med["repeat_kv (sdpa)"] / med["folded"],
        "same_logits": True,
    }


def main() -> None:
    parser = traffic_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(tokens=48)
    parser.add_argument("--forward", action="store_true", help="time one prefill forward, not the traffic")
    parser.add_argument("--past", type=int, default=1500, help="--forward: cached tokens per row")
    args = parser.parse_args()
    if args.forward:
        result = one_forward(args.past, args.rounds)
        write_result("grouped_attention_forward", result)
        return
    variants = {"repeat_kv (sdpa)": {"attn_implementation": "sdpa"}, "folded": {}}
    runs, results = run_variants(args, variants, KEYS[1:])
    a, b = ([(r.token_ids, r.finish_reason) for ep in eps for r in ep] for eps in results.values())
    assert a == b, "the engines answered differently"
    med = medians(runs, KEYS)
    base, new = med["repeat_kv (sdpa)"], med["folded"]
    summary = {
        "speedup": base["seconds"] / new["seconds"],
        "prefill_speedup": base["prefill_seconds"] / new["prefill_seconds"],
        "replies": len(a),
        "same_tokens": True,
        "median": med,
    }
    write_result("grouped_attention", summary, {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
