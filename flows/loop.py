"""The loop's stages, in order: the one list every runner of the loop reads (`LOOP`).

    generation 0    evaluate                      the starting champion: the baseline
    generation g    [collect →] explore → diagnose → distill → verify → finetune → evaluate

`collect` runs only with `traffic.learn` (what the gateway met in use becomes tasks).

Each stage is a Prefect flow in its own module, named here by import path so that reading
the list imports nothing (the CLI checks stage names before Prefect starts); what a `Stage`
is and what its flow returns: `ratchet.flows.stage`. A new stage is one module and one line
here. Everything below the list is read from it when called, so a test may replace `LOOP`.

`promote` is not a stage: `verify` and `finetune` promote their winners themselves under
`verify.promotion = "auto"`; otherwise a person does (CLI, dashboard, API, the `promote` flow).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ratchet.flows.stage import Stage

if TYPE_CHECKING:
    from ratchet.config import Settings
    from ratchet.flows.journal import GenerationRow


# What each stage's journal summary adds to the generation table (`flows/journal.py`). They
# read plain JSON, old journals included: a key added later is read with `.get`.
def fill_explore(row: GenerationRow, s: dict[str, Any]) -> None:
    row.explore_success = s["success_rate"]
    row.explore_ci95 = tuple(s["ci95"])  # type: ignore[assignment]
    if "searched" in s:
        row.explore_searched = tuple(s["searched"])  # type: ignore[assignment]


def fill_verify(row: GenerationRow, s: dict[str, Any]) -> None:
    row.candidates = s["verify_candidates"]
    row.promoted += s["promoted"]
    row.rejected += len(s["rejected"])


def fill_finetune(row: GenerationRow, s: dict[str, Any]) -> None:
    row.adapter = s["action"] if s.get("version") is None else f"v{s['version']} {s['status']}"
    if s.get("status") == "promoted":
        row.promoted.append(f"adapter v{s['version']}")


def fill_evaluate(row: GenerationRow, s: dict[str, Any]) -> None:
    row.test_successes, row.test_n = s["successes"], s["n"]
    row.test_ci95 = tuple(s["ci95"])  # type: ignore[assignment]
    row.policy_version = s["policy_version"]
    base = s.get("baselines") or {}  # absent in journals written before baselines were kept
    if base.get("random"):
        row.random_success = base["random"]["rate"]
        row.random_ci95 = tuple(base["random"]["ci95"])  # type: ignore[assignment]
    if base.get("gold"):
        row.gold_success = base["gold"]["rate"]
    if s.get("vs_random"):
        row.vs_random_p = s["vs_random"]["p_value"]
    if s.get("by_task"):  # absent in journals written before it was kept
        row.test_by_task = dict(s["by_task"])


def learns_from_use(settings: Settings) -> bool:
    return settings.traffic.learn


LOOP: tuple[Stage, ...] = (
    Stage("collect", "ratchet.flows.collect:collect_flow", in_run=True, wanted=learns_from_use),
    Stage(
        "explore",
        "ratchet.flows.explore:explore",
        traced=True,
        in_run=True,
        distributed=True,
        splits=("train",),
        fill=fill_explore,
    ),
    Stage("diagnose", "ratchet.flows.diagnose:diagnose_flow", in_run=True),
    Stage("distill", "ratchet.flows.distill:distill_flow", in_run=True),
    Stage("verify", "ratchet.flows.verify:verify_flow", gated=True, distributed=True, fill=fill_verify),
    Stage("finetune", "ratchet.flows.finetune:finetune_flow", gated=True, fill=fill_finetune),
    Stage(
        "evaluate",
        "ratchet.flows.evaluate:evaluate",
        traced=True,
        in_run=True,
        baseline=True,
        distributed=True,
        splits=("test",),
        fill=fill_evaluate,
    ),
)


def stage(name: str) -> Stage:
    """The stage called `name` (a KeyError if the loop has none)."""
    for s in LOOP:
        if s.name == name:
            return s
    raise KeyError(name)


def stage_names() -> tuple[str, ...]:
    """Every stage, in the loop's order."""
    return tuple(s.name for s in LOOP)


def run_stages(settings: Settings | None = None) -> tuple[str, ...]:
    """What plain `ratchet run` runs: a generation without the gates."""
    return tuple(s.name for s in LOOP if s.in_run and s.runs_with(settings))


def gated(names: Collection[str]) -> bool:
    """Whether any of `names` gates candidates, so needs a dev split the gate can decide on."""
    return any(s.gated for s in LOOP if s.name in names)


def splits(names: Collection[str]) -> tuple[str, ...]:
    """The splits whose tasks `names` play, in the loop's order (`ratchet evaluate` alone needs
    no train split as large as `splits.train`)."""
    return tuple(dict.fromkeys(sp for s in LOOP if s.name in names for sp in s.splits))


def traced(name: str) -> bool:
    """Whether a sample of stage `name`'s rollouts is traced (False for anything not a stage)."""
    return any(s.traced for s in LOOP if s.name == name)


def distributed(name: str) -> bool:
    """Whether stage `name`'s rollouts may run on Dask or Ray workers (False for any other flow)."""
    return any(s.distributed for s in LOOP if s.name == name)


def stages_of(generation: int, settings: Settings | None = None) -> tuple[str, ...]:
    """The stages of generation `generation`: the baseline ones in generation 0, all after;
    under `settings`, those they run."""
    return tuple(s.name for s in LOOP if (generation > 0 or s.baseline) and s.runs_with(settings))


def stage_flow(name: str) -> Any:
    """The Prefect flow of stage `name` (imported on first use)."""
    return stage(name).flow()
