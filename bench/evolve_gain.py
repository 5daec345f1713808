"""The headline: held-out success per generation of `ratchet evolve` on the embedded default.

Three generations (after the generation-0 baseline) for one TextWorldExpress game and one
reasoning-gym dataset, each its own evolution and data dir, one embedded server. For every
generation: test success with a 95% Wilson interval, the random valid-action policy's level
on the same test tasks with a sign test of the generation against it, and what was promoted
(skills, tools, the adapter). The goal is stated against random: first beat it
significantly, then approach the gold path.

    .venv/bin/python -m bench evolve_gain [--generations 3] [--train 40] [-k 4] [--test 30]
        [--dev 32] [--targets textworld-express:coin reasoning-gym:propositional_logic] [--data DIR]
        [--set KEY=VALUE ...]

`--data DIR` resumes a killed run (the evolve journal skips finished stages); with `--report`
it runs nothing and reports the journals so far; `--redraw FILE.json` redraws the table and
the plot (FILE.png) from a results file. Writes bench/results/evolve_gain.json and
evolve_gain.png (the plot for the README).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench._evolve import EvolveOptions, run


@dataclass
class Options(EvolveOptions):
    """The headline's options: those of bench/_evolve.py as they are."""


__all__ = ["Options", "run"]
