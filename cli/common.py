"""What every CLI module shares: the consoles, the global options, settings and the error guard."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape

from ratchet import shutdown
from ratchet.config import Settings, load_settings
from ratchet.errors import RatchetError
from ratchet.runtime_env import prepare_environment

if TYPE_CHECKING:
    from ratchet.decisions import Action

# A log (output to a file, a pipe, a scheduler) has no width: tables are printed whole, never
# cut to 80 columns with '…'.
LOG_WIDTH = 1000
console = Console(width=None if sys.stdout.isatty() else LOG_WIDTH)
err = Console(stderr=True, width=None if sys.stderr.isatty() else LOG_WIDTH)

GLOBAL: dict[str, Any] = {}

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML settings file (default ./ratchet.toml)")
]
DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", help="where all state lives")]
SuiteOpt = Annotated[str | None, typer.Option("--suite", "-s", help="suite[:subset,...]")]
EndpointOpt = Annotated[
    str | None, typer.Option("--endpoint", help="OpenAI-compatible base URL; empty = embedded")
]
GenOpt = Annotated[int, typer.Option("--generation", "-g", min=0, help="generation number")]
ReasonOpt = Annotated[str, typer.Option("--reason", "-r", help="why (kept in the audit log)")]
ByOpt = Annotated[str | None, typer.Option("--by", help="who decides (default: your user name)")]


def load(**overrides: Any) -> Settings:
    """Settings from ratchet.toml < RATCHET_* environment < global flags < these overrides."""
    flat = {k: v for k, v in GLOBAL.items() if k != "config"} | overrides
    settings = load_settings(flat, config_file=GLOBAL.get("config"))
    for line in prepare_environment(settings):
        err.print(line, highlight=False, markup=False, soft_wrap=True)
    # their INFO lines drown the progress bars
    for noisy in ("mlflow", "alembic", "py4j", "httpx", "distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return settings


def change(kind: Literal["skill", "adapter"], name: str, action: Action, reason: str, by: str | None) -> None:
    """A person's decision on a candidate of either kind, through `ratchet.decisions.apply`
    (one transaction: refused in one line with nothing changed, or applied and reported, a
    mirror that failed after the record being a warning line, exit 0), reported with the live
    policy before and after it."""
    import getpass

    from ratchet.decisions import apply, check_decision, verb
    from ratchet.flows.runtime import champion_policy, open_library
    from ratchet.kinds import same_name
    from ratchet.training.registry import ADAPTER, AdapterRegistry

    who = by or getpass.getuser()
    check_decision(name, who, reason)  # before any state is opened or created
    settings = load()
    # MLflow's agent versions follow the decision: open_library subscribes them to the lifecycle
    library, registry = open_library(settings), AdapterRegistry(settings)
    before, was = champion_policy(settings, library).version, registry.champion()
    candidates = library if kind == "skill" else registry
    outcome = apply(candidates, name, action, who=who, why=reason)
    label = same_name if kind == "skill" else ADAPTER.label
    done = f"{verb(action)}: " + ", ".join(label(n) for n in outcome.changed)
    try:  # the decision is on disk: reading the result back must not turn it into an error
        after, now = champion_policy(settings, library).version, registry.champion()
    except Exception as exc:  # noqa: BLE001 - reported as a warning below
        outcome.warnings.append(f"the live policy could not be read back: {_first_line(exc)}")
        console.print(done, highlight=False)
    else:
        console.print(f"{done} · live policy {before} → {after}", highlight=False)
        if kind == "adapter":
            console.print(f"champion: {_adapter(now)} (was {_adapter(was)})")
    for line in outcome.warnings:
        err.print(f"[yellow]warning:[/] {escape(done)}; {escape(line)}", highlight=False, soft_wrap=True)


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type if it has none)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _adapter(v: Any) -> str:
    from ratchet.training.registry import ADAPTER

    return "the base model" if v is None else ADAPTER.label(v.name)


@contextmanager
def guard() -> Iterator[None]:
    """Print a RatchetError as one `error:` line (exit 2); Ctrl-C as one line (exit 130)."""
    try:
        yield
    except RatchetError as exc:  # escaped: a message may quote text holding '[...]'
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        stopped = shutdown.why()  # the watchdog's, else a person's Ctrl-C or kill
        if stopped is not None:
            reason, code = stopped
            again = "run the same command again to resume"
            err.print(f"[bold red]error:[/] {escape(reason)}; {again}", highlight=False, soft_wrap=True)
            raise typer.Exit(code) from None
        err.print("interrupted: finished rollouts are stored; run the same command again to resume")
        raise typer.Exit(130) from None
