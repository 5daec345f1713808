"""CLI for the policy's LoRA adapters: `ratchet adapters list|show|promote|reject|retire|rollback`."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ratchet.cli.common import ByOpt, ReasonOpt, change, console, guard, load
from ratchet.errors import AdapterStateError

adapters_app = typer.Typer(
    help="LoRA adapters of the policy (MLflow registry; the `champion` alias is live).", no_args_is_help=True
)


def _registry():  # type: ignore[no-untyped-def]
    from ratchet.training.registry import AdapterRegistry

    return AdapterRegistry(load())


def _gate(v: Any) -> str:
    e = v.evidence
    if "repairs" not in e:
        return "-"
    return f"+{e['repairs']} −{e['regressions']} p={e['p_value']:.3g} ({e['rollouts']} rollouts)"


@adapters_app.command("list")
def adapters_list() -> None:
    """Every trained adapter: status, gate evidence, which one is the champion."""
    with guard():
        registry = _registry()
        versions = registry.list()
        if not versions:
            console.print("no adapters yet: `ratchet finetune` trains one from explored successes")
            return
        table = Table("version", "status", "champion", "sha256", "dataset", "gate", title=registry.name)
        for v in versions:
            table.add_row(
                str(v.version),
                v.status,
                "★" if v.champion else "",
                v.sha256[:12],
                v.dataset,
                escape(_gate(v)),
            )
        console.print(table)


@adapters_app.command("show")
def adapters_show(version: int) -> None:
    """One adapter: tags, gate evidence, audit trail."""
    with guard():
        registry = _registry()
        v = registry.get(version)
        console.print(
            f"[bold]{registry.name} v{v.version}[/] · {v.status}{' · champion' if v.champion else ''}"
        )
        console.print(f"sha256 {v.sha256}\nserved as {v.served_name}\nsource {v.source}\nrun {v.run_id}")
        console.print(f"dataset {v.dataset} · config {v.config}")
        if v.evidence:
            console.print(escape(json.dumps({k: x for k, x in v.evidence.items() if k != "pairs"}, indent=2)))
        for r in registry.lifecycle.records(v.name):
            console.print(
                f"{r.at:%Y-%m-%d %H:%M:%S}  {r.from_status or '-'} → {r.to_status}  "
                f"by {r.who}: {escape(r.why)}"
            )


@adapters_app.command("promote")
def adapters_promote(version: int, reason: ReasonOpt, by: ByOpt = None) -> None:
    """Make a verified (or retired) adapter the champion: the next rollouts use it."""
    with guard():
        change("adapter", str(version), "promote", reason, by)


@adapters_app.command("reject")
def adapters_reject(version: int, reason: ReasonOpt, by: ByOpt = None) -> None:
    """Reject a candidate or verified adapter."""
    with guard():
        change("adapter", str(version), "reject", reason, by)


@adapters_app.command("retire")
def adapters_retire(version: int, reason: ReasonOpt, by: ByOpt = None) -> None:
    """Retire a promoted adapter; if it was the champion, the one promoted before it is live."""
    with guard():
        change("adapter", str(version), "retire", reason, by)


@adapters_app.command("rollback")
def adapters_rollback(
    reason: ReasonOpt,
    version: Annotated[
        int | None, typer.Argument(help="the promotion to undo (default: the champion)")
    ] = None,
    by: ByOpt = None,
) -> None:
    """Undo a promotion and every later one: the champion is what it was before (or the base model)."""
    with guard():
        if version is None:
            champion = _registry().champion()
            if champion is None:
                raise AdapterStateError("there is no champion adapter to roll back", "nothing to do")
            version = champion.version
        change("adapter", str(version), "rollback", reason, by)
