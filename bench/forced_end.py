"""Agent traffic through the embedded engine: replies finished where the grammar forces the
rest (`Engine.forced_end`), against decoding every forced token.

The same workload as `bench/prefill_groups.py` (8 coin rollouts at once, each step's exact
prompt and tool grammar, greedy), but each reply is decoded to its end (`--tokens` is only
the output budget), as the actor's calls are. The two engines run interleaved, `--rounds`
times each, in one process. Every reply must have the same text, finish reason and grammar
completeness in both (asserted); token ids may split the same text differently.

    .venv/bin/python bench/forced_end.py [--rollouts 16] [--steps 15] [--rounds 2]

Writes bench/results/forced_end.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _setup import write_result  # noqa: E402
from prefill_groups import medians, run_variants, traffic_parser  # noqa: E402

KEYS = ("seconds", "decode_seconds", "prefill_seconds", "kv_seconds", "grammar_seconds", "forward_steps")


def main() -> None:
    parser = traffic_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(tokens=48)
    args = parser.parse_args()
    variants = {"token by token": {"forced_end": False}, "forced end": {"forced_end": True}}
    runs, results = run_variants(args, variants, KEYS[1:])
    replies = {
        name: [[(a.text, a.finish_reason, a.grammar_complete) for a in ep] for ep in eps]
        for name, eps in results.items()
    }
    a, b = replies.values()
    assert a == b, "the engines answered differently"
    steps = sum(len(ep) for ep in a)
    med = medians(runs, KEYS)
    base, new = med["token by token"], med["forced end"]
    summary = {
        "speedup": base["seconds"] / new["seconds"],
        "decode_seconds": {name: m["decode_seconds"] for name, m in med.items()},
        "batched_decode_forwards_per_reply": {name: m["forward_steps"] / steps for name, m in med.items()},
        "replies": steps,
        "same_replies": True,
        "median": med,
    }
    write_result("forced_end", summary, {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
