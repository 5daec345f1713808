"""`ratchet traffic`: what the gateway met in use, and what the next generation learns from it."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ratchet.cli.common import console, guard, load

traffic_app = typer.Typer(
    help="What the gateway met in use: requests with feedback, and the tasks learned from them.",
    no_args_is_help=True,
)


@traffic_app.command("collect")
def collect_now(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="count what would be learned; write nothing")
    ] = False,
) -> None:
    """Turn the gateway's recorded requests that users gave an expected answer for into tasks
    (the learned task file), as each generation's `collect` stage does with traffic.learn. Run
    it between runs: a generation plays the tasks it started with."""
    with guard():
        settings = load()
        from ratchet.flows.traffic import collect

        found = collect(settings, write=not dry_run)
        split = ", ".join(f"{n} {s}" for s, n in found.by_split.items())
        verb = "would learn" if dry_run else "learned"
        console.print(
            f"{found.traces} answers with feedback read; {verb} {found.new} new tasks ({found.items} in all: "
            f"{split}); {found.duplicates} seen before, {found.conflicts} conflicting answers, "
            f"{found.flagged} flagged by the injection screen, {found.too_long} too long; "
            f"{found.failures} marked wrong without an expected answer (`ratchet traffic failures`)",
            highlight=False,
        )
        if not dry_run:
            console.print(f"learned tasks: {settings.traffic_file}", soft_wrap=True, highlight=False)
        if not settings.traffic.learn:
            console.print("traffic.learn is off: `ratchet evolve` does not play them until it is on")


@traffic_app.command("failures")
def failures_now() -> None:
    """Answers users marked wrong without saying what was right: the loop cannot check a fix for
    them, so they wait for an expected answer (POST /v1/feedback with `expected`)."""
    with guard():
        settings = load()
        from ratchet.flows.traffic import collect

        found = collect(settings, write=False)
        rows = found.failed
        if not rows:
            console.print("no answer is marked wrong without an expected answer")
            return
        table = Table("trace", "policy", "request", "answer", "comment")
        for f in rows:
            table.add_row(
                f["trace"],
                f["policy"],
                escape(f["input"][:80]),
                escape(f["reply"][:60]),
                escape(f["comment"][:60]),
            )
        console.print(table)
