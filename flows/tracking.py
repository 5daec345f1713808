"""MLflow bookkeeping: one experiment per evolution, a parent run, a child run per generation.

Runs are found again by tags, so rerunning a stage of a generation (after a crash, or
`ratchet evaluate` after `ratchet explore`) logs into the same generation run instead of
starting a new one.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

from ratchet.config import Settings
from ratchet.flows import mlflow_imports, traces  # noqa: F401 - mlflow_imports: patched on import
from ratchet.types import Trajectory

KIND, EVOLUTION, GENERATION = "ratchet.kind", "ratchet.evolution", "ratchet.generation"


def experiment_name(evolution: str) -> str:
    return f"ratchet-{evolution}"


def setup_experiment(settings: Settings) -> str:
    """The evolution's experiment id (created with its artifact location on first use)."""
    mlflow.set_tracking_uri(settings.mlflow_uri)
    name = experiment_name(settings.evolution)
    client = MlflowClient()
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = (settings.mlflow_artifacts / settings.evolution).as_uri()
    return client.create_experiment(name, artifact_location=location)


def setup(settings: Settings) -> str:
    """Point MLflow at the data dir's store; return the evolution's experiment id. LangGraph
    autolog is on when rollouts are sampled for tracing (`flows/traces.py` picks which)."""
    exp_id = setup_experiment(settings)
    mlflow.set_experiment(experiment_id=exp_id)
    # MLflow's exporter offers every exported trace to a notebook display, which imports
    # IPython (not installed: so on every trace) on the exporter's thread; a run has no notebook
    mlflow.tracing.disable_notebook_display()
    if settings.trace_sample_rate > 0:
        traces.enable_autolog(settings.mlflow_uri)
    else:
        traces.disable_autolog()
    return exp_id


def _find_run(client: MlflowClient, exp_id: str, tags: dict[str, str]) -> str | None:
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    runs = client.search_runs(
        [exp_id], filter_string=query, max_results=1, order_by=["attributes.start_time ASC"]
    )
    return runs[0].info.run_id if runs else None


def generation_run_id(settings: Settings, generation: int) -> str:
    """The generation's MLflow run id ("" if no stage of it has run yet)."""
    tags = {KIND: "generation", EVOLUTION: settings.evolution, GENERATION: str(generation)}
    return _find_run(MlflowClient(), setup_experiment(settings), tags) or ""


@contextmanager
def generation_run(settings: Settings, generation: int) -> Iterator[str]:
    """Open (or reopen) the evolution's parent run and the generation's child run; yield its id.

    Tracing is off inside (the teacher's graphs, verify arms); the sampled explore and evaluate
    rollouts turn it on for themselves (`traces.rollout_trace`)."""
    exp_id = setup(settings)
    client = MlflowClient()
    evo_tags = {KIND: "evolution", EVOLUTION: settings.evolution}
    parent_id = _find_run(client, exp_id, evo_tags)
    gen_tags = {KIND: "generation", EVOLUTION: settings.evolution, GENERATION: str(generation)}
    child_id = _find_run(client, exp_id, gen_tags)
    while mlflow.active_run() is not None:
        mlflow.end_run()
    with mlflow.start_run(
        run_id=parent_id, run_name=f"evolution {settings.evolution}", tags=None if parent_id else evo_tags
    ):
        with (
            mlflow.start_run(
                run_id=child_id,
                nested=True,
                run_name=f"generation {generation}",
                tags=None if child_id else gen_tags,
            ) as child,
            mlflow.tracing.context(enabled=False),
        ):
            yield child.info.run_id


def log_params(params: dict[str, Any]) -> None:
    """Params are immutable in MLflow: a rerun with a changed value records it as a tag instead."""
    run = mlflow.active_run()
    assert run is not None
    existing = MlflowClient().get_run(run.info.run_id).data.params
    fresh = {k: str(v) for k, v in params.items() if k not in existing}
    if fresh:
        mlflow.log_params(fresh)
    for k, v in params.items():
        if k in existing and existing[k] != str(v):
            mlflow.set_tag(f"param_changed.{k}", str(v))


def log_trajectory_sample(trajectories: list[Trajectory], stage: str, per_outcome: int = 3) -> None:
    """A few successes and failures as JSONL, for reading in the MLflow UI."""
    wins = [t for t in trajectories if t.success][:per_outcome]
    losses = [t for t in trajectories if not t.success][:per_outcome]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{stage}_trajectories.jsonl"
        path.write_text("".join(t.model_dump_json() + "\n" for t in wins + losses))
        mlflow.log_artifact(str(path), artifact_path="samples")


def log_success_plot(by_task: dict[str, float], stage: str, title: str) -> None:
    """Bar chart of success rate per task: what a person would rather see than read."""
    labels = {k.split(":", 1)[1]: v for k, v in by_task.items()}  # drop the suite prefix
    log_bar_plot(labels, f"plots/{stage}_success_by_task.png", title, "success rate", ylim=1.05)


def log_bar_plot(
    values: dict[str, float], artifact: str, title: str, ylabel: str, ylim: float | None = None
) -> None:
    """A labelled bar chart as an MLflow figure artifact."""
    plt = pyplot()
    labels = list(values)
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(labels) + 2), 4))
    ax.bar(range(len(labels)), list(values.values()), color="#3b7dd8")
    ax.set_xticks(range(len(labels)), labels, rotation=70, ha="right", fontsize=7)
    if ylim is not None:
        ax.set_ylim(0, ylim)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    mlflow.log_figure(fig, artifact)
    plt.close(fig)


def log_gate_plot(outcomes: dict[str, tuple[int, int, str]]) -> None:
    """Repairs and regressions of each gated candidate, labelled with where it ended."""
    plt = pyplot()
    names = list(outcomes)
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(names) + 2), 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [outcomes[n][0] for n in names], 0.4, label="repairs", color="#2e9e5b")
    ax.bar([i + 0.2 for i in x], [outcomes[n][1] for n in names], 0.4, label="regressions", color="#d8453b")
    ax.set_xticks(list(x), [f"{n}\n({outcomes[n][2]})" for n in names], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("dev tasks")
    ax.set_title("verify: gate outcomes per candidate")
    ax.legend()
    fig.tight_layout()
    mlflow.log_figure(fig, "plots/verify_gate_outcomes.png")
    plt.close(fig)


def log_success_curve(settings: Settings, points: list[tuple[int, float, float, float]]) -> None:
    """Held-out success per generation (with 95% intervals) so far, to every generation's
    run it covers and to the evolution's parent run, outside any active run."""
    fig = success_figure({settings.evolution: points}, f"evolution {settings.evolution}: held-out success")
    gens = [p[0] for p in points]
    client = MlflowClient(settings.mlflow_uri)
    exp_id = setup_experiment(settings)
    targets = [_find_run(client, exp_id, {KIND: "evolution", EVOLUTION: settings.evolution})]
    gen_tags = {KIND: "generation", EVOLUTION: settings.evolution, GENERATION: str(gens[-1])}
    targets.append(_find_run(client, exp_id, gen_tags))
    for run_id in filter(None, targets):
        client.log_figure(run_id, fig, "plots/success_curve.png")
    pyplot().close(fig)


def success_figure(
    series: dict[str, list[tuple[int, float, float, float]]],
    title: str,
    ylabel: str = "held-out test success (95% CI)",
) -> Any:
    """Success per generation with 95% intervals, one line per series of (gen, rate, lo, hi)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        gens, rate = [p[0] for p in points], [p[1] for p in points]
        err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
        ax.errorbar(gens, rate, yerr=err, marker="o", capsize=4, label=label)
    ax.set_xticks(sorted({p[0] for points in series.values() for p in points}))
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("generation")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    return fig


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_summary(summary: dict[str, Any], stage: str) -> None:
    mlflow.log_text(json.dumps(summary, indent=2, default=str), f"summary/{stage}.json")


def audit_logger(settings: Settings) -> Callable[[Any], None]:
    """Log each skill status change (who, when, why, evidence) to the evolution's parent run,
    whichever process made it (a flow, the CLI, the HTTP API), without touching active runs."""

    def log(record: Any) -> None:
        run_id = evolution_run_id(settings)
        stamp = record.at.strftime("%Y%m%dT%H%M%S%f")
        MlflowClient().log_text(
            run_id, record.model_dump_json(indent=2), f"audit/{record.name}/{stamp}-{record.to_status}.json"
        )

    return log


def evolution_run_id(settings: Settings) -> str:
    """The evolution's parent run (created if no stage has run yet), found without touching
    active runs: what a decision made outside a stage is recorded on."""
    mlflow.set_tracking_uri(settings.mlflow_uri)
    client = MlflowClient()
    exp_id = setup_experiment(settings)
    tags = {KIND: "evolution", EVOLUTION: settings.evolution}
    return (
        _find_run(client, exp_id, tags)
        or client.create_run(exp_id, tags=tags, run_name=f"evolution {settings.evolution}").info.run_id
    )
