"""The evolution journal: which stages of which generation finished, and what each found.

One JSON file per evolution (`Settings.evolve_journal`), rewritten atomically after every
stage, so a kill leaves either the old journal or the new one, never half of one. `evolve`
reads it to resume; the CLI table and the dashboard read it to show generations.

A stage's record holds its outcome's `summary()` (`ratchet.flows.stage.StageOutcome`); what
that summary adds to its generation's row is the stage's `fill` (`ratchet.flows.loop.LOOP`).
Reading a journal imports no Prefect: the pre-flight reads it before anything starts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ratchet.agents.baselines import beats_random, versus_random
from ratchet.config import Settings
from ratchet.errors import StateFileError
from ratchet.files import check_regular_file, nested_deeper_than, write_text_atomic
from ratchet.flows import loop
from ratchet.flows.stage import no_fill


@dataclass
class StageRecord:
    generation: int
    stage: str
    summary: dict[str, Any]
    wall_seconds: float
    finished_at: str
    flow_run_id: str = ""  # the stage's Prefect flow run ("" in journals written before it was kept)


@dataclass
class GenerationRow:
    """One line of the evolution table: what a generation achieved and cost."""

    generation: int
    test_successes: int | None = None
    test_n: int | None = None
    test_ci95: tuple[float, float] | None = None
    explore_success: float | None = None  # train split, sampled (T = explore.temperature)
    explore_ci95: tuple[float, float] | None = None
    explore_searched: tuple[int, int] | None = None  # searched rollouts after the sampled ones, successes
    candidates: int = 0  # gated by verify this generation
    promoted: list[str] = field(default_factory=list)
    rejected: int = 0
    adapter: str = ""
    tokens: int = 0
    wall_seconds: float = 0.0
    policy_version: str = ""
    stages: list[str] = field(default_factory=list)
    flow_runs: dict[str, str] = field(default_factory=dict)  # stage -> Prefect flow run id

    random_success: float | None = None  # the random valid-action policy on the same test tasks
    random_ci95: tuple[float, float] | None = None
    gold_success: float | None = None  # the suite's reference solutions on the same test tasks
    vs_random_p: float | None = None  # one-sided sign test: the policy beats random, task by task
    test_by_task: dict[str, float] | None = None  # each test task's success rate (its rollouts')
    # Against generation 0 on the same test tasks and seeds, where no random level exists to read
    # a generation against (a task file): the same paired sign test as against random.
    vs_first_better: int | None = None  # tasks this generation solves more often than generation 0
    vs_first_worse: int | None = None
    vs_first_p: float | None = None  # one-sided: P(at least `better` of better+worse | no difference)

    @property
    def beats_random(self) -> bool:
        return beats_random(self.vs_random_p)

    @property
    def beats_first(self) -> bool:
        """Better than generation 0 by the sign test (p <= 0.05), as ▲ marks beating random."""
        return beats_random(self.vs_first_p)

    @property
    def test_success(self) -> float | None:
        return None if not self.test_n else (self.test_successes or 0) / self.test_n


@dataclass
class Journal:
    path: Path
    evolution: str
    records: list[StageRecord] = field(default_factory=list)

    @classmethod
    def load(cls, settings: Settings) -> Journal:
        path = settings.evolve_journal
        if not check_regular_file(path, "the evolution journal"):
            return cls(path, settings.evolution)
        try:
            raw = json.loads(path.read_bytes())
            if nested_deeper_than(raw, MAX_DEPTH):  # the table, a page or the next write would recurse
                raise ValueError(f"nested too deep: more than {MAX_DEPTH} levels")
            journal = cls(path, settings.evolution, _RECORDS.validate_python(raw["stages"]))
            journal.rows()  # every summary as the table reads it: a wrong type is found here, not by a page
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise StateFileError(
                f"the evolution journal {path} is unreadable ({_why(exc)})",
                "move it away to start the evolution's bookkeeping afresh (stages rerun from the stores)",
            ) from None
        except OSError as exc:
            raise StateFileError(
                f"cannot read the evolution journal {path}: {exc.strerror or exc}", "check its permissions"
            ) from None
        return journal

    def done(self, generation: int, stage: str) -> bool:
        return any(r.generation == generation and r.stage == stage for r in self.records)

    def finished_through(self, settings: Settings) -> int:
        """The last generation every earlier one finished with every stage (-1: not even the
        baseline), under `settings` (a stage they leave out is not waited for)."""
        g = -1
        while all(self.done(g + 1, stage) for stage in loop.stages_of(g + 1, settings)):
            g += 1
        return g

    def record(
        self,
        generation: int,
        stage: str,
        summary: dict[str, Any],
        wall_seconds: float,
        flow_run_id: str = "",
    ) -> None:
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        record = StageRecord(generation, stage, summary, round(wall_seconds, 1), stamp, flow_run_id)
        self.records.append(record)
        body = {"evolution": self.evolution, "stages": [asdict(r) for r in self.records]}
        write_text_atomic(self.path, json.dumps(body, indent=2))

    def rows(self) -> list[GenerationRow]:
        """One row per generation, its fields checked against their types (a ValueError)."""
        rows: dict[int, GenerationRow] = {}
        fills = {s.name: s.fill for s in loop.LOOP}  # a stage no longer in the loop adds its time only
        for r in self.records:
            row = rows.setdefault(r.generation, GenerationRow(r.generation))
            row.stages.append(r.stage)
            row.wall_seconds += r.wall_seconds
            row.tokens += r.summary.get("tokens", 0)
            if r.flow_run_id:
                row.flow_runs[r.stage] = r.flow_run_id
            fills.get(r.stage, no_fill)(row, r.summary)
        checked = [_ROW.validate_python(asdict(rows[g])) for g in sorted(rows)]
        pair_with_first(checked)
        return checked


def pair_with_first(rows: list[GenerationRow]) -> None:
    """Each later generation against generation 0, task by task on the same test tasks (the
    exact sign test `versus_random` runs against random): what a task file, which has no random
    level, is read against. Left empty where either side has no per-task record."""
    first = next((r for r in rows if r.generation == 0), None)
    if first is None or not first.test_by_task:
        return
    for row in rows:
        if row.generation == 0 or not row.test_by_task:
            continue
        v = versus_random(row.test_by_task, first.test_by_task)
        if v.better + v.worse + v.ties:
            row.vs_first_better, row.vs_first_worse, row.vs_first_p = v.better, v.worse, v.p_value


# A journal is read back with its types checked (pydantic, lax: 3.0 is a fine int), so a
# hand-edited or foreign one is one StateFileError at load (the pre-flight), not a TypeError
# deep in a table or a page.
_RECORDS = TypeAdapter(list[StageRecord])
_ROW = TypeAdapter(GenerationRow)
# A journal ratchet writes is a few levels deep; one nested deeper was written by hand (or to
# break the reader), and is refused at load, before any reader recurses into it.
MAX_DEPTH = 32


def _why(exc: Exception) -> str:
    """One line: pydantic's first error (where, what), or the exception's text."""
    if isinstance(exc, RecursionError):  # the JSON decoder's own limit (about 1,000 levels)
        return f"nested too deep: more than {MAX_DEPTH} levels"
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError | AttributeError) else str(exc)
