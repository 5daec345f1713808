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
    prepare_environment(settings)
    # their INFO lines drown the progress bars
    for noisy in ("mlflow", "alembic", "py4j", "httpx", "distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return settings


def change(kind: Literal["skill", "adapter"], name: str, action: Action, reason: str, by: str | None) -> None:
    """A person's decision on a candidate of either kind, through `ratchet.decisions.decide`,
    reported with the live policy before and after it."""
    import getpass

    from ratchet.decisions import decide, verb
    from ratchet.flows import agent_versions
    from ratchet.flows.runtime import champion_policy, open_library
    from ratchet.training.registry import AdapterRegistry

    settings = load()
    library, registry = open_library(settings), AdapterRegistry(settings)
    before, was = champion_policy(settings, library).version, registry.champion()
    candidates = library if kind == "skill" else registry
    who = by or getpass.getuser()
    changed = decide(candidates, name, action, who=who, why=reason)
    agent_versions.sync(settings, library, by=who)  # MLflow's agent versions and prompts follow
    after, now = champion_policy(settings, library).version, registry.champion()
    names = ", ".join(changed if kind == "skill" else (f"adapter v{n}" for n in changed))
    console.print(f"{verb(action)}: {names} · live policy {before} → {after}")
    if kind == "adapter":
        console.print(f"champion: {_adapter(now)} (was {_adapter(was)})")


def _adapter(v: Any) -> str:
    return "the base model" if v is None else f"adapter v{v.version}"


@contextmanager
def guard() -> Iterator[None]:
    """Print a RatchetError as one `error:` line (exit 2); Ctrl-C as one line (exit 130)."""
    try:
        yield
    except RatchetError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err.print("interrupted: finished rollouts are stored; run the same command again to resume")
        raise typer.Exit(130) from None
