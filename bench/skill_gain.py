"""What the loop gains without fine-tuning: skills, action rules and tools only.

evolve_gain with `finetune.mode = "off"`: 3 generations of `ratchet evolve` on the embedded
default per target, own successes only (no expert trajectories), 30 held-out test tasks per
target. Per target and generation: test success with its 95% interval, the random
valid-action policy on the same tasks with a sign test against it, what was promoted (with
its kind), how many candidates were rejected, and wall time.

Targets: TextWorldExpress coin and mapreader, and reasoning-gym propositional_logic, the
dataset whose greedy base rate on the shipped model lies between 10% and 60% (6/30 = 20%,
bench/RESULTS.md), so that a gain and a loss can both show.

    .venv/bin/python -m bench skill_gain [--targets ...] [--train 12] [-k 2] [--dev 32] [--test 30]
        [--data DIR] [--report]

Writes bench/results/skill_gain.{json,png}; `--data DIR` resumes a killed run.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench._evolve import EvolveOptions, run
from bench.harness import option


@dataclass
class Options(EvolveOptions):
    targets: list[str] = option(
        ["textworld-express:coin", "textworld-express:mapreader", "reasoning-gym:propositional_logic"]
    )
    # a mined rule needs its evidence in 2 distinct train tasks, not many rollouts of one:
    # 12 tasks x 2 rollouts (24 a generation, the headline's 40 x 4 is 160)
    train: int = option(12, "train tasks per target")
    k: int = option(2, "explore rollouts per train task", flags=("-k",))
    finetune: str = option("off", "finetune.mode: off (skills, rules, tools only), auto (LoRA here)")
    name: str = option("skill_gain", "results file name under bench/results")


__all__ = ["Options", "run"]
