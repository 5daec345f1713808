"""bf16 against fp32 on held-out tasks, paired: does the faster number format lose tasks?

bench/bf16_prefill.py measures the speed and how often a greedy token changes; this measures
what the loop is judged by. Two embedded servers, one per format (`model.dtype`), on the same
machine; for each family the real `evaluate` stage, greedy, on the first `--test` test tasks,
each policy (the base model, and base plus the no-repeat rule the loop promotes first on
coin) played on fp32 and then on bf16 with the same tasks and seeds (`bench/_paired.py`).
Per arm: successes, repairs and regressions of bf16 against fp32 with the exact one-sided p
of a loss, prefill seconds and wall time. On a CPU without native bf16 units bf16 is
emulated: the success comparison still holds there, the times do not.

    .venv/bin/python bench/bf16_heldout.py [--families textworld-express:coin ...] [--test 30]

Writes bench/results/bf16_heldout.json and prints the table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _paired import Arm, evaluate_arms, table, write_result  # noqa: E402

FAMILIES = ["textworld-express:coin", "textworld-express:mapreader"]
DTYPES = ("float32", "bfloat16")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=FAMILIES)
    p.add_argument("--test", type=int, default=30, help="held-out test tasks per family")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--name", default="bf16_heldout")
    args = p.parse_args()
    from ratchet.runtime_env import stop_on_signals

    stop_on_signals()  # a killed run stops its servers

    from ratchet.server.launcher import EmbeddedServer
    from ratchet.server.precision import BF16_FLAGS, cpu_flags, native_bf16
    from ratchet.server.weights import ensure_hf_copy

    ensure_hf_copy(ROOT / ".ratchet" / "models")  # once, before two servers would both convert it
    data = Path(tempfile.mkdtemp(prefix="ratchet-bf16-heldout-"))
    families = []
    with ExitStack() as stack:
        arms = {
            dtype: Arm(
                stack.enter_context(EmbeddedServer(ROOT / ".ratchet" / "models", data / dtype, dtype=dtype))
            )
            for dtype in DTYPES
        }
        for family in args.families:
            families.append(evaluate_arms(family, arms, data, args.test, args.concurrency))
    print(table(families, "float32"))
    write_result(
        args.name,
        args,
        {
            "cpu_bf16_flags": sorted(set(BF16_FLAGS) & cpu_flags()),
            "native_bf16": native_bf16(),
            "families": families,
        },
    )


if __name__ == "__main__":
    main()
