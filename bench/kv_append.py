"""Agent traffic through the embedded engine: the KV cache before and after it was reworked.

The same workload as `bench/prefill_groups.py` (8 coin rollouts at once, each step's exact
prompt and tool grammar, greedy, `--tokens` decoded per step). Three engines, interleaved
`--rounds` times each in one process:

* **before** — transformers' `DynamicLayer` behaviour, emulated on the same code path: every
  update rebuilds the buffer at exactly its used size (copies every column of every row
  and layer, as `torch.cat` does), and a finished row's cache is copied out at once;
* **in place, eager** — keys and values in buffers with spare columns (a decode step writes
  one column), finished rows still copied out at once;
* **after** — what ships (`server/kv_cache.py`, `server/engine.py`): in place, and finished
  rows ride along until the next admission drops them in the copy it makes anyway (or
  until half the batch is finished).

(The engine before also merged with pad-then-cat, one copy more than the one-copy merge
all three use here, so the ratio slightly understates the change.)

All answer with the same tokens (asserted). Reports the wall-time ratio and the engine's
clocks by part (decode, KV bookkeeping).

    .venv/bin/python bench/kv_append.py [--rollouts 16] [--steps 15] [--rounds 2]

Writes bench/results/kv_append.json.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _setup import write_result  # noqa: E402
from prefill_groups import medians, run_variants, traffic_parser  # noqa: E402


@contextmanager
def concatenating() -> Iterator[None]:
    """Make every KV update copy the whole cache, as `DynamicLayer`'s torch.cat does."""
    from ratchet.server import kv_cache

    update, spare_min, growth = kv_cache.GrowingLayer.update, kv_cache.SPARE_MIN, kv_cache.GROWTH

    def copy_all(self: Any, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
        self._published = None  # not ours any more: the next update rebuilds from keys/values
        return update(self, key_states, value_states, *args, **kwargs)

    kv_cache.GrowingLayer.update, kv_cache.SPARE_MIN, kv_cache.GROWTH = copy_all, 0, 0.0  # type: ignore[method-assign]
    try:
        yield
    finally:
        kv_cache.GrowingLayer.update, kv_cache.SPARE_MIN, kv_cache.GROWTH = update, spare_min, growth  # type: ignore[method-assign]


def main() -> None:
    args = traffic_parser(__doc__.split("\n\n")[0]).parse_args()
    variants = {"before": {"compact_share": 0.0}, "in place, eager": {"compact_share": 0.0}, "after": {}}
    keys = ("seconds", "decode_seconds", "kv_seconds")
    runs, answers = run_variants(args, variants, keys[1:] + ("prefill_seconds",), {"before": concatenating})
    tokens = {name: [[r.token_ids for r in ep] for ep in eps] for name, eps in answers.items()}
    assert all(t == tokens["after"] for t in tokens.values()), "the engines answered differently"
    med = medians(runs, keys)
    summary = {
        "speedup": med["before"]["seconds"] / med["after"]["seconds"],
        "decode_ratio": med["before"]["decode_seconds"] / med["after"]["decode_seconds"],
        "kv_ratio": med["before"]["kv_seconds"] / med["after"]["kv_seconds"],
        "median": med,
        "same_answers": True,
    }
    write_result("kv_append", summary, {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
