"""`ratchet doctor`: the installation, then the pre-flight of a run on this configuration.

A run's pre-flight (`flows/preflight.py`) stops at the first problem; the doctor runs
the same checks and goes on past each, so a new configuration's every problem is one line at
once. It starts nothing and writes nothing: no Prefect, no MLflow, no model server, no
endpoint, not even the data dir (only whether it could be made is checked).
"""

from __future__ import annotations

import typer
from rich.markup import escape

from ratchet.checks import Checks
from ratchet.cli.common import GLOBAL, console, err, guard
from ratchet.config import Settings, config_path, load_settings


def doctor() -> None:
    """Check the installation (the shipped model, every suite plug-in, the tool sandbox), then run
    `ratchet evolve`'s pre-flight on this configuration without starting anything: the settings,
    the suite (a task file parsed, its split counts printed, its scoring function imported), your
    agent's entry point, the splits at their sizes, the port, the data dir. Each problem is one
    line; any problem: exit 2."""
    with guard():
        problems = installation()
        checks = Checks(stop_at_first=False)
        settings = _settings(checks)
        if settings is not None:
            configuration(settings, checks)
        for note in checks.notes:
            console.print(note, highlight=False, markup=False, soft_wrap=True)
        for line in checks.problems:
            err.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        if problems or checks.problems:
            raise typer.Exit(2)
        console.print("[green]ratchet is installed[/], and this configuration passes a run's pre-flight")


def installation() -> int:
    """The shipped model, every suite plug-in (a broken one is a line of its own), the sandbox
    (a warning: only tool candidates need it); returns how many plug-ins failed."""
    from ratchet.server.weights import shipped_gguf
    from ratchet.skills.sandbox import SandboxUnavailableError, check_isolation
    from ratchet.suites.registry import available_suites, failure_line, get_suite

    console.print(f"model weights: {shipped_gguf()}")
    broken = []
    for name in sorted(available_suites()):
        try:
            suite = get_suite(name)
            try:
                suite.check()
            finally:
                suite.close()
        except Exception as exc:  # noqa: BLE001 - one broken plug-in must not hide the others
            err.print(
                f"[bold red]suite {name}: error:[/] {failure_line(exc)}", highlight=False, soft_wrap=True
            )
            broken.append(name)
            continue
        console.print(f"suite {name}: ok")
    try:
        check_isolation()
        console.print("tool sandbox (bubblewrap): ok")
    except SandboxUnavailableError as exc:  # the loop runs; only tool candidates are refused
        err.print(f"[yellow]warning:[/] {exc} (until then, tool candidates are refused)", highlight=False)
    if broken:
        err.print(
            f"{len(broken)} suite plug-in(s) failed: {', '.join(broken)}; fix or reinstall them "
            "(`ratchet suites list` shows each; a plug-in written for the first suite contract: "
            "docs/extending.md, 'Porting a plug-in from the first contract')",
            highlight=False,
            soft_wrap=True,
        )
    return len(broken)


def _settings(checks: Checks) -> Settings | None:
    """The settings a run would read (ratchet.toml or --config < RATCHET_* < flags), without
    preparing the data dir as a run does; None (and a problem) when they cannot be built."""
    found: list[Settings] = []
    flat = {k: v for k, v in GLOBAL.items() if k != "config"}
    checks.run(lambda: found.append(load_settings(flat, config_file=GLOBAL.get("config"))))
    if found:
        source = config_path()
        console.print(f"settings: {source if source is not None else 'the defaults (no ratchet.toml)'}")
    return found[0] if found else None


def configuration(settings: Settings, checks: Checks) -> None:
    """`ratchet evolve`'s pre-flight, every check run: the data dir (never created here), MLflow's
    database, the stored state, the suite and its splits, your agent, the endpoint or the port."""
    from ratchet.flows.preflight import preflight
    from ratchet.runtime_env import check_data_dir_unmade, check_mlflow_store, offline_environment

    offline_environment()  # a user's module imported below must not phone home either
    checks.run(lambda: check_data_dir_unmade(settings.data_dir))
    checks.run(lambda: check_mlflow_store(settings.data_dir / "mlflow.db"))
    preflight(settings, gate=True, checks=checks)  # what `ratchet evolve` checks: train, dev, test
