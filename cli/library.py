"""CLI for what the loop learns: `ratchet failures`, `ratchet skills …`, `ratchet tools …`."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ratchet.cli.common import ByOpt, ReasonOpt, change, console, err, guard, load
from ratchet.errors import ConfigError

if TYPE_CHECKING:
    from ratchet.config import Settings

skills_app = typer.Typer(
    help="The skill library: candidates, verified, promoted, retired.", no_args_is_help=True
)
tools_app = typer.Typer(help="Distilled tools, served over MCP.", no_args_is_help=True)

StatusOpt = Annotated[
    str | None, typer.Option("--status", help="candidate, verified, promoted, retired or rejected")
]


def _library():  # type: ignore[no-untyped-def]
    from ratchet.flows.runtime import open_library

    settings = load()
    return settings, open_library(settings)


def failures(
    generation: Annotated[int | None, typer.Option("--generation", "-g", help="one generation")] = None,
    cluster: Annotated[str | None, typer.Option(help="list one cluster's members")] = None,
) -> None:
    """Failure modes and clusters of diagnosed failures (run `ratchet diagnose` first)."""
    with guard():
        from ratchet.memory.trajectory_store import open_store

        settings = load()
        diagnoses = open_store(settings.trajectories_db).diagnoses(settings.evolution, generation)
        if not diagnoses:
            console.print("no diagnoses yet: run `ratchet diagnose` after `ratchet explore`")
            return
        if cluster is not None:
            members = [d for d in diagnoses if d.cluster == cluster]
            if not members:
                raise ConfigError(f"no cluster {cluster!r}", "see `ratchet failures` for cluster ids")
            table = Table("trajectory", "task", "step", "diagnosis")
            for d in members:
                table.add_row(d.trajectory_id, d.task_id, str(d.step), escape(d.summary()))
            console.print(table)
            return
        modes = Table("failure mode", "failures", "share", title=f"{len(diagnoses)} diagnosed failures")
        for mode, n in Counter(d.mode for d in diagnoses).most_common():
            modes.add_row(mode, str(n), f"{n / len(diagnoses):.0%}")
        console.print(modes)
        by_cluster: dict[str, list] = {}
        for d in diagnoses:
            by_cluster.setdefault(d.cluster or "(unclustered)", []).append(d)
        clusters = Table("cluster", "size", "example")
        for cid, members in sorted(by_cluster.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            clusters.add_row(cid, str(len(members)), escape(members[0].summary()[:120]))
        console.print(clusters)


@skills_app.command("list")
def skills_list(
    status: StatusOpt = None,
    kind: Annotated[
        str | None, typer.Option(help="a kind the library files (an unknown one is refused with the list)")
    ] = None,
    family: Annotated[str | None, typer.Option(help="suite:subset")] = None,
) -> None:
    """List skills with their status and provenance; refused files are named below the table."""
    with guard():
        if kind is not None:  # before any state is opened
            import ratchet.skills.kinds  # noqa: F401  (registers the library's kinds)
            from ratchet.kinds import kinds_in

            known = [k.name for k in kinds_in("skills")]
            if kind not in known:
                raise ConfigError(f"no skill kind named {kind!r}", f"choose from {', '.join(known)}")
        _, library = _library()
        skills, errors = library.scan()
        table = Table("name", "kind", "status", "family", "gen", "from", "description")
        for s in skills:
            if (
                (status and s.status != status)
                or (kind and s.kind != kind)
                or (family and s.family != family)
            ):
                continue
            row = [s.name, s.kind, s.status, s.family, str(s.generation), f"{len(s.provenance)} traj"]
            table.add_row(*row, escape(s.description[:80]))
        console.print(table)
        for line in errors:
            err.print(f"[yellow]refused:[/] {escape(line)}", soft_wrap=True)


@skills_app.command("show")
def skills_show(name: str) -> None:
    """One skill: its SKILL.md, its tool code, its provenance and its audit history."""
    with guard():
        from ratchet.skills.format import render

        settings, library = _library()
        skill = library.get(name)
        console.print(escape(render(skill)), highlight=False)
        if skill.tool is not None:
            console.print(f"[bold]scripts/tool.py[/] ({skill.tool.kind})")
            console.print(escape(skill.tool.code), highlight=False)
        if skill.rule is not None:
            console.print("[bold]scripts/rule.json[/] (applied to the menu of valid actions)")
            console.print(escape(skill.rule.model_dump_json(indent=2)), highlight=False)
        if skill.constraint is not None:
            console.print("[bold]scripts/constraint.json[/] (written into the tools' schemas)")
            console.print(escape(skill.constraint.model_dump_json(indent=2)), highlight=False)
        for i, d in enumerate(skill.exemplars or (), 1):
            console.print(f"[bold]solved task {i}[/] ({d.trajectory}): {escape(d.task)}", soft_wrap=True)
            console.print(f"  {escape(' → '.join(d.actions))}", highlight=False, soft_wrap=True)
        console.print(f"[bold]provenance[/]: {', '.join(skill.provenance)}", soft_wrap=True)
        if how := evidence_kinds(settings, skill.provenance):
            console.print(f"  from {how}", highlight=False)
        for r in library.history(name):
            console.print(
                f"{r.at:%Y-%m-%d %H:%M} {r.from_status or '-'} → {r.to_status} by {r.who}: {escape(r.why)}"
            )


def evidence_kinds(settings: Settings, ids: list[str]) -> str:
    """How a candidate's evidence was played: '3 sampled, 1 searched, 1 expert' (searched
    rollouts went back along a stored one and branched: `agents/search.py`); '' if none is stored."""
    from ratchet.memory.trajectory_store import open_store

    if not settings.trajectories_db.is_file():
        return ""
    store = open_store(settings.trajectories_db)
    try:
        found = [t for i in ids if (t := store.get(i)) is not None]
    finally:
        store.close()
    counts = Counter("searched" if t.branch else "expert" if t.kind == "expert" else "sampled" for t in found)
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


@tools_app.command("list")
def tools_list(status: StatusOpt = None) -> None:
    """Distilled tools and their parameters."""
    with guard():
        _, library = _library()
        table = Table("name", "status", "kind", "parameters", "description")
        for s in library.list(kind="tool"):
            if s.tool is None or (status and s.status != status):
                continue
            params = ", ".join(s.tool.parameters.get("properties", {})) or "-"
            table.add_row(s.name, s.status, s.tool.kind, params, escape(s.description[:80]))
        console.print(table)


@tools_app.command("serve")
def tools_serve(
    status: Annotated[str, typer.Option(help="serve tools with this status")] = "promoted",
    transport: Annotated[str, typer.Option(help="stdio or http")] = "stdio",
    port: Annotated[int, typer.Option(help="HTTP port on 127.0.0.1")] = 8765,
    source: Annotated[
        Path | None, typer.Option("--from", help="an export's tools/ folder (`ratchet export`) instead")
    ] = None,
) -> None:
    """Serve distilled tools to any MCP client (every call runs in the sandbox). Over HTTP it
    answers only loopback Host names and no foreign Origin (`dashboard/hosts.py`)."""
    with guard():
        from ratchet.skills.toolbox import Toolbox

        if transport not in ("stdio", "http"):
            raise ConfigError(f"unknown transport {transport!r}", "use --transport stdio or http")
        if source is not None:  # an export's tools, each checked against its hashes
            from ratchet.flows.export import exported_tools

            settings, tools = load(), exported_tools(source)
        else:
            settings, library = _library()
            tools = [s for s in library.list(kind="tool") if s.status == status]
        if not tools:
            raise ConfigError(f"no {status} tools in {settings.skills_dir}", "see `ratchet tools list`")
        box = Toolbox(tools, settings.distill.tool_timeout_s, settings.distill.tool_memory_mb)
        err.print(
            f"serving {len(tools)} tools over {transport}"
            + (f" on 127.0.0.1:{port}" if transport == "http" else "")
        )
        if transport == "http":
            from starlette.middleware import Middleware

            from ratchet.dashboard.hosts import LoopbackOnly

            # a web page reaches 127.0.0.1 through the browser (DNS rebinding, cross-site
            # posts): the dashboard's Host/Origin rules, on reads too (the event stream)
            wall = [Middleware(LoopbackOnly, every_method=True)]
            box.mcp.run(transport="http", host="127.0.0.1", port=port, show_banner=False, middleware=wall)
        else:
            box.mcp.run(transport="stdio", show_banner=False)


@skills_app.command("promote")
def skills_promote(name: str, reason: ReasonOpt, by: ByOpt = None) -> None:
    """Promote a verified skill: it goes live for the next rollouts."""
    with guard():
        change("skill", name, "promote", reason, by)


@skills_app.command("reject")
def skills_reject(name: str, reason: ReasonOpt, by: ByOpt = None) -> None:
    """Reject a candidate or verified skill."""
    with guard():
        change("skill", name, "reject", reason, by)


@skills_app.command("retire")
def skills_retire(name: str, reason: ReasonOpt, by: ByOpt = None) -> None:
    """Retire a promoted skill (it stops being live)."""
    with guard():
        change("skill", name, "retire", reason, by)


@skills_app.command("rollback")
def skills_rollback(name: str, reason: ReasonOpt, by: ByOpt = None) -> None:
    """Undo a promotion and every promotion after it: the live policy is what it was before."""
    with guard():
        change("skill", name, "rollback", reason, by)
