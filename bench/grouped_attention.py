"""Agent traffic through the embedded engine: grouped-query attention with the query heads
folded onto their key/value head (`server.attention`), against transformers' `sdpa`, which
copies every key and value per query head (`repeat_kv`) in each prefill forward.

The same workload as `bench/prefill_groups.py` (8 coin rollouts at once, each step's exact
prompt and tool grammar, greedy, each reply decoded to its end). The two engines run
interleaved, `--rounds` times each, in one process. The logits are the same to the bit
(`tests/test_engine.py`), so every reply must be the same token for token (asserted).

    .venv/bin/python bench/grouped_attention.py [--rollouts 16] [--steps 15] [--rounds 2]

Writes bench/results/grouped_attention.json.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from prefill_groups import run_variants, traffic_parser  # noqa: E402

KEYS = ("seconds", "prefill_seconds", "decode_seconds", "kv_seconds", "prefilled_tokens")


def main() -> None:
    parser = traffic_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(tokens=48)
    args = parser.parse_args()
    variants = {"repeat_kv (sdpa)": {"attn_implementation": "sdpa"}, "folded": {}}
    runs, results = run_variants(args, variants, KEYS[1:])
    a, b = ([(r.token_ids, r.finish_reason) for ep in eps for r in ep] for eps in results.values())
    assert a == b, "the engines answered differently"
    med = {name: {k: statistics.median(r[k] for r in v) for k in KEYS} for name, v in runs.items()}
    base, new = med["repeat_kv (sdpa)"], med["folded"]
    summary = {
        "speedup": base["seconds"] / new["seconds"],
        "prefill_speedup": base["prefill_seconds"] / new["prefill_seconds"],
        "replies": len(a),
        "same_tokens": True,
        "median": med,
    }
    print(json.dumps(summary, indent=2))
    out = ROOT / "bench" / "results" / "grouped_attention.json"
    out.write_text(json.dumps({"args": vars(args), "runs": runs, **summary}, indent=2))


if __name__ == "__main__":
    main()
