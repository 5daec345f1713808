"""The `ratchet` command (Typer + Rich), the top layer: flows, the dashboard and the stores are imported here.

Every command builds one Settings from ratchet.toml < RATCHET_* environment < flags, and
any RatchetError (bad input, missing Java, unreachable endpoint, port in use) is printed
as one line with exit code 2.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ratchet.cli.adapters import adapters_app
from ratchet.cli.common import (
    GLOBAL,
    ConfigOpt,
    DataDirOpt,
    EndpointOpt,
    GenOpt,
    SuiteOpt,
    console,
    err,
    guard,
    load,
)
from ratchet.cli.doctor import doctor
from ratchet.cli.export import export
from ratchet.cli.gateway import gateway
from ratchet.cli.library import failures, skills_app, tools_app
from ratchet.cli.suites import suites_app
from ratchet.cli.traffic import traffic_app
from ratchet.config import Settings
from ratchet.errors import ConfigError, RatchetError

app = typer.Typer(
    help="Make LLM agents improve themselves from their own trajectories.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
traj_app = typer.Typer(help="Stored trajectories.", no_args_is_help=True)
app.add_typer(suites_app, name="suites")
app.add_typer(traj_app, name="trajectories")
app.add_typer(skills_app, name="skills")
app.add_typer(tools_app, name="tools")
app.add_typer(adapters_app, name="adapters")
app.add_typer(traffic_app, name="traffic")


@app.callback()
def _options(
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    suite: SuiteOpt = None,
    endpoint: EndpointOpt = None,
    evolution: Annotated[str | None, typer.Option(help="evolution name")] = None,
    seed: Annotated[int | None, typer.Option(help="base seed")] = None,
    concurrency: Annotated[int | None, typer.Option(help="rollouts in flight")] = None,
) -> None:
    GLOBAL.update(
        config=config,
        data_dir=data_dir,
        suite=suite,
        evolution=evolution,
        seed=seed,
        concurrency=concurrency,
        **{"model.endpoint": endpoint},
    )


@contextmanager
def _progress(settings: Settings) -> Iterator[None]:
    """Rich progress bars on a terminal; in a log (output to a file, a scheduler) one plain
    line per stage start and end instead, with the time, since a log has no live display.
    The watchdog watches the same progress: a run stuck for `evolve.watchdog_s` is ended."""
    from ratchet.watchdog import watching

    with watching(settings.evolve.watchdog_s), _bars():
        yield


@contextmanager
def _bars() -> Iterator[None]:
    from ratchet.flows.progress import StageEvent, listen

    if not console.is_terminal:

        def on_stage(event: StageEvent) -> None:
            stamp = datetime.now().strftime("%H:%M:%S")
            console.print(f"{stamp} {event.line()}", highlight=False, markup=False, soft_wrap=True)

        with listen(lambda stage, done, total: None, on_stage):
            yield
        return

    bars: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description:>9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    ) as progress:

        def on_event(stage: str, done: int, total: int) -> None:
            if stage not in bars:
                bars[stage] = progress.add_task(stage, total=total)
            progress.update(bars[stage], completed=done, total=total)

        with listen(on_event):
            yield


def _start_prefect(settings: Settings) -> None:
    """Prefect's API before the first flow (a new data dir migrates its database first);
    Prefect's and MLflow's own INFO lines go to the data dir's logs from here on."""
    from ratchet.flows.prefect_api import start_prefect_api
    from ratchet.flows.service_logs import keep_service_logs

    keep_service_logs(settings.logs_dir)

    with err.status("starting Prefect's API (the first run in a data dir prepares its database)"):
        start_prefect_api()


def _launch(target: str, settings: Settings, generation: int, of: Sequence[str], **params: Any) -> Any:
    """Check the input of stages `of` (one clear line, nothing written), then run the flow
    `module:name` with progress bars. The flow module is imported only after the checks: importing
    Prefect creates its home in the data dir."""
    import importlib

    from ratchet.flows import loop
    from ratchet.flows.preflight import preflight

    preflight(settings, gate=loop.gated(of), splits=loop.splits(of))
    from ratchet.flows.launch import run_flow

    module, name = target.split(":")
    flow_obj = getattr(importlib.import_module(module), name)
    _start_prefect(settings)
    with _progress(settings):
        return run_flow(flow_obj, settings, generation=generation, **params)


def _one_stage(name: str, settings: Settings, generation: int) -> None:
    """`ratchet <stage>`: one stage of the loop (`ratchet.flows.loop.LOOP`), then what it found."""
    from ratchet.flows.loop import stage

    _launch(stage(name).flow_path, settings, generation, (name,)).render(console, settings)


# ------------------------------------------------------------------------------------ commands
@app.command()
def serve(
    port: Annotated[int, typer.Option(help="port on 127.0.0.1")] = 8000,
    max_batch: Annotated[int, typer.Option(help="max sequences per batch")] = 8,
) -> None:
    """Run the embedded model server in the foreground (OpenAI-compatible, on 127.0.0.1)."""
    with guard():
        settings = load()
        from ratchet.server.__main__ import main as server_main
        from ratchet.server.launcher import check_port_free

        check_port_free("127.0.0.1", port, "pass --port with another port")
        console.print(f"serving on http://127.0.0.1:{port}/v1 (Ctrl-C to stop)")
        model = settings.model
        args = ["--port", str(port), "--models-dir", str(settings.models_dir), "--max-batch", str(max_batch)]
        args += ["--dtype", model.dtype, "--kv-dtype", model.kv_dtype]
        args += ["--prefix-cache-mb", str(model.kv_cache_mb)]
        raise typer.Exit(server_main(args))


@app.command()
def explore(
    generation: GenOpt = 0,
    train: Annotated[int | None, typer.Option(help="train tasks per subset")] = None,
    k: Annotated[int | None, typer.Option("-k", help="rollouts per task")] = None,
) -> None:
    """Explore: k rollouts per train task, stored as trajectories (rerun = resume)."""
    with guard():
        settings = load(**{"splits.train": train, "explore.rollouts_per_task": k})
        _one_stage("explore", settings, generation)


@app.command()
def evaluate(
    generation: GenOpt = 0,
    test: Annotated[int | None, typer.Option(help="test tasks per subset")] = None,
) -> None:
    """Evaluate the policy on the held-out test split (fixed seeds)."""
    with guard():
        settings = load(**{"splits.test": test})
        _one_stage("evaluate", settings, generation)


@app.command()
def diagnose(generation: GenOpt = 0) -> None:
    """Diagnose every failed train rollout of a generation and cluster the failures (rerun = resume)."""
    with guard():
        settings = load()
        _one_stage("diagnose", settings, generation)


@app.command()
def distill(generation: GenOpt = 0) -> None:
    """Distill skill, guardrail and tool candidates from a generation (after `diagnose`)."""
    with guard():
        settings = load()
        _one_stage("distill", settings, generation)


app.command()(failures)


@app.command()
def verify(
    generation: GenOpt = 0,
    dev: Annotated[int | None, typer.Option(help="dev tasks per subset (the gate's budget)")] = None,
) -> None:
    """A/B-test every candidate against the champion on dev tasks; file verified or rejected."""
    with guard():
        settings = load(**{"splits.dev": dev})
        _one_stage("verify", settings, generation)


@app.command()
def finetune(
    generation: GenOpt = 0,
    dev: Annotated[int | None, typer.Option(help="dev tasks per subset (the gate's budget)")] = None,
) -> None:
    """Train a LoRA adapter on clean successes, gate it against the champion, promote if it wins."""
    with guard():
        settings = load(**{"splits.dev": dev})
        _one_stage("finetune", settings, generation)


@app.command()
def evolve(
    generations: Annotated[
        int | None, typer.Option("--generations", "-n", min=1, help="generations after the baseline")
    ] = None,
    train: Annotated[int | None, typer.Option(help="train tasks per subset")] = None,
    test: Annotated[int | None, typer.Option(help="test tasks per subset")] = None,
    k: Annotated[int | None, typer.Option("-k", help="rollouts per train task")] = None,
    dev: Annotated[int | None, typer.Option(help="dev tasks per subset (the gate's budget)")] = None,
    extend: Annotated[
        bool,
        typer.Option(
            "--extend", help="N more generations after the last finished one (as the nightly schedule runs)"
        ),
    ] = False,
) -> None:
    """Evolve: generation 0 is the baseline, then explore → … → evaluate per generation (rerun = resume)."""
    with guard():
        settings = load(
            **{
                "evolve.generations": generations,
                "splits.train": train,
                "splits.dev": dev,
                "splits.test": test,
                "explore.rollouts_per_task": k,
            }
        )
        from ratchet.flows.preflight import preflight

        preflight(settings, gate=True)  # one clear line, before Prefect is even imported
        from ratchet.cli.evolve import print_evolution
        from ratchet.flows.evolve import evolve_flow

        _start_prefect(settings)
        with _progress(settings):
            journal = evolve_flow(settings=settings, extend=extend)
        print_evolution(settings, journal)


@app.command()
def deploy(
    cron: Annotated[
        str | None, typer.Option(help="evolve's schedule (cron; default: deployments/prefect.yaml's)")
    ] = None,
    timezone: Annotated[
        str | None, typer.Option(help="the schedule's time zone (default: the file's)")
    ] = None,
) -> None:
    """Register the `evolve` (nightly) and `promote` deployments with a Prefect server and serve them."""
    with guard():
        settings = load()
        from ratchet.flows.launch import prefect_server_url
        from ratchet.flows.preflight import preflight

        url = prefect_server_url("PREFECT_API_URL is not set: deployments live on a Prefect server")
        from ratchet.flows.schedule import declared, serve_deployments

        preflight(settings)
        names = []
        for d in declared():
            when = f" ({cron or d.cron} {timezone or d.timezone})" if d.cron else ""
            names.append(f"{d.flow().name}/{d.name}{when}")
        config = GLOBAL.get("config") or (Path("ratchet.toml") if Path("ratchet.toml").is_file() else None)
        console.print(
            f"serving deployments {' and '.join(names)} on {url}; "
            "Ctrl-C stops serving (the schedule stays on the server)",
            soft_wrap=True,
        )
        overrides = {k: str(v) for k, v in GLOBAL.items() if k != "config" and v is not None}
        if "data_dir" in overrides:  # runs may start elsewhere: pin the data dir
            overrides["data_dir"] = str(settings.data_dir.resolve())
        serve_deployments(config, overrides, cron, timezone)


@app.command()
def run(
    generation: GenOpt = 0,
    train: Annotated[int | None, typer.Option(help="train tasks per subset")] = None,
    test: Annotated[int | None, typer.Option(help="test tasks per subset")] = None,
    k: Annotated[int | None, typer.Option("-k", help="rollouts per train task")] = None,
    stage: Annotated[
        list[str] | None,
        typer.Option("--stage", "-S", help="a stage of the loop to run (repeat; default: all but the gates)"),
    ] = None,
) -> None:
    """Run stages of one generation (default explore, diagnose, distill, evaluate, after collect
    with traffic.learn); print a summary."""
    with guard():
        from ratchet.flows.loop import run_stages, stage_names
        from ratchet.flows.stage import render_outcomes

        unknown = [s for s in stage or () if s not in stage_names()]
        if unknown:
            raise ConfigError(f"unknown stage {unknown[0]!r}", f"choose from {', '.join(stage_names())}")
        settings = load(**{"splits.train": train, "splits.test": test, "explore.rollouts_per_task": k})
        stages = tuple(stage or run_stages(settings))
        result = _launch("ratchet.flows.evolve:generation_flow", settings, generation, stages, stages=stages)
        render_outcomes(list(result.stages.values()), console, settings, run_id=result.run_id)


@app.command()
def api(port: Annotated[int, typer.Option(help="port on 127.0.0.1")] = 8780) -> None:
    """Serve the HTTP API for deciding on skills (promote, reject, retire, rollback)."""
    with guard():
        import uvicorn

        from ratchet.dashboard.api import create_app
        from ratchet.server.launcher import check_port_free

        settings = load()
        check_port_free("127.0.0.1", port, "pass --port with another port")
        app_ = create_app(settings)  # writes the token on the first start, refuses a leaked one
        console.print(
            f"API on http://127.0.0.1:{port}/api (docs: /api/docs; changes need `Authorization: Bearer` "
            f"with the token in {settings.data_dir}/dashboard.token; Ctrl-C to stop)",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
        uvicorn.run(app_, host="127.0.0.1", port=port, log_level="warning")


@app.command()
def dashboard(
    port: Annotated[int | None, typer.Option(help="port on 127.0.0.1 (default: dashboard.port)")] = None,
) -> None:
    """Serve the dashboard: generations, champion history, skills with A/B evidence, decisions.
    Its URL carries the data dir's token (DATA_DIR/dashboard.token, made on the first start):
    the page needs it to decide, as a script needs it in `Authorization: Bearer`."""
    with guard():
        import uvicorn

        from ratchet.dashboard.app import create_dashboard
        from ratchet.memory.vector_index import embed
        from ratchet.server.launcher import check_port_free

        settings = load()
        port = port or settings.dashboard.port
        check_port_free("127.0.0.1", port, "pass --port or set dashboard.port")
        app_ = create_dashboard(settings)  # writes the token on the first start, refuses a leaked one
        embed(["warm up"])  # a decision re-indexes the skill: load the embedding model now, not on a click
        console.print(
            f"dashboard on http://127.0.0.1:{port}/?token={app_.state.token} "
            f"(API: /api/docs, changes need `Authorization: Bearer` with the token in "
            f"{settings.data_dir}/dashboard.token; Ctrl-C to stop)",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
        uvicorn.run(app_, host="127.0.0.1", port=port, log_level="warning")


app.command()(doctor)
app.command()(export)
app.command()(gateway)


@traj_app.command("list")
def trajectories_list(
    generation: Annotated[int | None, typer.Option("--generation", "-g")] = None,
    split: Annotated[str | None, typer.Option(help="train, dev or test")] = None,
    task: Annotated[str | None, typer.Option(help="task id")] = None,
    success: Annotated[
        bool | None, typer.Option("--success/--failure", help="only successes / failures")
    ] = None,
    limit: Annotated[int, typer.Option(help="rows to show")] = 50,
) -> None:
    """List stored trajectories (newest filters first: generation, split, task, outcome)."""
    with guard():
        from ratchet.memory.trajectory_store import open_store

        settings = load()
        store = open_store(settings.trajectories_db)
        filters = {
            "evolution": settings.evolution,
            "generation": generation,
            "split": split,
            "task_id": task,
            "success": success,
        }
        rows = store.summaries(**filters, limit=limit)
        total = store.count(**filters)
        table = Table("id", "gen", "task", "split", "#", "outcome", "score", "steps", "tokens", "s")
        for r in rows:
            outcome = "error" if r.status == "error" else ("[green]success[/]" if r.success else "failure")
            table.add_row(
                r.id,
                str(r.generation),
                r.task_id,
                r.split,
                str(r.rollout),
                outcome,
                f"{r.score:.2f}",
                str(r.n_steps),
                str(r.prompt_tokens + r.completion_tokens),
                f"{r.seconds:.1f}",
            )
        console.print(table)
        console.print(f"{len(rows)} of {total} shown")


@traj_app.command("show")
def trajectories_show(trajectory_id: str) -> None:
    """Show one trajectory step by step."""
    with guard():
        from ratchet.memory.trajectory_store import open_store

        store = open_store(load().trajectories_db)
        t = store.get(trajectory_id)
        if t is None:
            raise RatchetError(f"no trajectory {trajectory_id!r}", "see 'ratchet trajectories list'")
        outcome = "error" if t.status == "error" else ("success" if t.success else "failure")
        console.print(
            f"[bold]{t.id}[/] {t.task_id} rollout {t.rollout}  policy {t.policy_version}  "
            f"{outcome} (score {t.score:.2f}) in {t.n_steps} steps, {t.seconds:.1f} s"
        )
        console.print(f"[dim]task:[/] {escape(t.instruction)}")
        if t.branch is not None:
            console.print(
                f"[dim]searched:[/] replayed steps 0-{t.branch.step - 1} of {t.branch.parent} without the "
                f"model, branched at step {t.branch.step}"
                if t.branch.step
                else f"[dim]searched:[/] branched at the start, away from what {t.branch.parent} did",
                highlight=False,
            )
        for s in t.steps:
            if s.tool_call is not None:
                call = f"{s.tool_call.name}({s.tool_call.args})"
            else:  # a text reply the episode took as its turn, or a reply that called no tool
                call = f"reply: {s.message[:200]!r}" if s.moves_on else f"(no tool call) {s.message[:200]!r}"
            console.print(f"[bold cyan]{s.index:>3}[/] {escape(f'[{s.source}] {call}')}", highlight=False)
            if s.error:
                console.print(f"      [red]{escape(s.error)}[/]", highlight=False)
            console.print(f"      {escape(s.tool_result[:400])}", highlight=False)
        if t.error:
            console.print(f"[red]rollout error:[/] {escape(t.error)}")


@traj_app.command("export")
def trajectories_export(
    path: Path,
    generation: Annotated[int | None, typer.Option("--generation", "-g")] = None,
    split: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Export trajectories as JSONL (one trajectory per line)."""
    with guard():
        from ratchet.memory.trajectory_store import open_store

        settings = load()
        n = open_store(settings.trajectories_db).export_jsonl(
            path, evolution=settings.evolution, generation=generation, split=split
        )
        console.print(f"wrote {n} trajectories to {path}")


def main() -> None:
    from ratchet.shutdown import run_main

    run_main(app)


if __name__ == "__main__":
    main()
