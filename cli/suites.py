"""CLI for task suites: `ratchet suites list` (every subset, its split sizes) and `ratchet
suites check` (the conformance kit a plug-in author runs on a suite)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ratchet.cli.common import console, guard

suites_app = typer.Typer(
    help="Task suites (plug-ins under the 'ratchet.suites' entry point group).", no_args_is_help=True
)


def _size(n: int | None) -> str:
    return "generated" if n is None else f"{n:,}"


@suites_app.command("list")
def suites_list(
    name: Annotated[str | None, typer.Argument(help="only this suite")] = None,
) -> None:
    """List installed suites, every subset of each (* = a default), and its split sizes."""
    with guard():
        from ratchet.suites import available_suites, get_suite

        table = Table("suite", "subset", "train", "dev", "test")
        found = available_suites()
        about = []
        for suite_name in sorted(found) if name is None else [name]:
            suite = get_suite(suite_name)  # an unknown name is one line with the installed ones
            try:
                for i, subset in enumerate(suite.available_subsets()):
                    sizes = suite.split_sizes(subset)
                    mark = " *" if subset in suite.default_subsets else ""
                    row = (_size(sizes[s]) for s in ("train", "dev", "test"))
                    table.add_row(suite_name if i == 0 else "", subset + mark, *row)
                about.append(f"{suite_name}: version {suite.version}, plug-in {found[suite_name].value}")
            finally:
                suite.close()
        console.print(table)
        console.print("* a default subset ('-s NAME' takes these; '-s NAME:a,b' picks others)")
        for line in about:
            console.print(escape(line), highlight=False)


@suites_app.command("check")
def suites_check(
    spec: Annotated[str, typer.Argument(help="suite spec: 'name' or 'name:subset,subset'")],
    tasks: Annotated[int, typer.Option(help="tasks of each subset and split to look at")] = 3,
) -> None:
    """Run the conformance kit on a suite: one line per promise of the suite contract."""
    with guard():
        from ratchet.conformance import check_suite
        from ratchet.suites import get_suite

        suite = get_suite(spec)
        try:
            suite.check()
            results = check_suite(suite, tasks)
        finally:
            suite.close()
        for r in results:
            mark = "[green]ok[/]  " if r.ok else "[red]FAIL[/]"
            console.print(f"{mark} {r.name}: {escape(r.detail)}", highlight=False)
        failed = [r.name for r in results if not r.ok]
        if failed:
            console.print(f"[red]{len(failed)} of {len(results)} checks failed[/]")
            raise typer.Exit(1)
        console.print(f"[green]{spec} keeps all {len(results)} promises of the suite contract[/]")
