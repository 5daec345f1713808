"""A stage of the loop, as the runners read it: one `Stage` per stage, listed in order in
`ratchet.flows.loop.LOOP`.

A stage is a Prefect flow `(settings, generation=0, base_url=None) -> outcome` in a module
of its own, and one line in that list. The line says how the loop treats it (`traced`,
`gated`, `in_run`, `baseline`) and what its journal summary adds to the generation table
(`fill`), and when settings leave it out (`wanted`). The outcome it returns follows
`StageOutcome`: `summary()` is what the journal records, `render()` what the CLI prints.
Nothing else in ratchet lists the stages:
`evolve_flow` and `generation_flow` (`flows/evolve.py`), the journal's table
(`flows/journal.py`), the CLI (`ratchet run`, `ratchet <stage>`) and the traces
(`flows/traces.py`) all read the list.

Reading this module or the list imports no Prefect: the flow is named by its import path
and imported by `Stage.flow()` on first use, and `fill` works on plain JSON.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import Console

    from ratchet.config import Settings
    from ratchet.flows.journal import GenerationRow


class StageOutcome(Protocol):
    """What a stage's flow returns (explore and evaluate: `flows/rollouts.py:StageResult`).

    `summary()` is plain JSON for the journal (`flows/journal.py`): a reader of old journals
    relies on its keys, so change them only by adding. The generation table reads it back
    through the stage's `fill`, and `tokens`, when present, is added to the generation's cost.

    `render(console, settings, run_id)` prints it for a person (`ratchet <stage>`, `ratchet
    run`); `run_id` is the generation's MLflow run when known. A type whose outcomes read
    better side by side may also define a classmethod `render_all(outcomes, console,
    settings, run_id=None)`: `render_outcomes` then prints all of them at once, once per
    type, after the others (explore and evaluate share one table, which ends with the
    run's policy, trajectories and MLflow run)."""

    def summary(self) -> dict[str, Any]: ...

    def render(self, console: Console, settings: Settings, run_id: str | None = None) -> None: ...


Fill = Callable[["GenerationRow", dict[str, Any]], None]


def no_fill(row: GenerationRow, summary: dict[str, Any]) -> None:
    """A stage that adds nothing to the generation table beyond its name, time and tokens."""


@dataclass(frozen=True)
class Stage:
    """One stage of the loop: its name, its flow, and how the runners treat it."""

    name: str
    flow_path: str  # "module:attr" of its Prefect flow, imported by `flow()` on first use
    traced: bool = False  # a sample of its rollouts is traced to MLflow (`flows/traces.py`)
    gated: bool = False  # it runs the A/B gate, so it needs a dev split large enough for it
    splits: tuple[str, ...] = ()  # the splits whose tasks it plays: preflight checks they can be built
    in_run: bool = False  # plain `ratchet run` (no --stage) runs it
    baseline: bool = False  # it runs in generation 0, the baseline (every stage runs in g >= 1)
    distributed: bool = False  # its rollouts go to Dask or Ray workers when `evolve.task_runner` says so
    fill: Fill = no_fill  # what its journal summary adds to a `GenerationRow`
    wanted: Callable[[Settings], bool] | None = None  # None: always; else whether these settings run it

    def runs_with(self, settings: Settings | None) -> bool:
        """Whether the runners run it under `settings` (None: settings not known, so only a stage
        that always runs)."""
        return self.wanted is None or (settings is not None and self.wanted(settings))

    def flow(self) -> Any:
        """The stage's Prefect flow (importing it imports Prefect)."""
        module, attr = self.flow_path.split(":")
        return getattr(importlib.import_module(module), attr)


def render_outcomes(
    outcomes: Sequence[StageOutcome], console: Console, settings: Settings, run_id: str | None = None
) -> None:
    """Print the outcomes of several stages (`ratchet run`), in the order given: each on its
    own, except those whose type has `render_all`, which are printed together at the end,
    one call per type in the order the types first appear."""
    groups: dict[type, list[Any]] = {}
    for out in outcomes:
        if hasattr(type(out), "render_all"):
            groups.setdefault(type(out), []).append(out)
        else:
            out.render(console, settings, run_id=run_id)
    for kind, members in groups.items():
        kind.render_all(members, console, settings, run_id=run_id)  # type: ignore[attr-defined]
