"""CLI for task suites: `ratchet suites list` (every subset, its split sizes) and `ratchet
suites check` (the conformance kit a plug-in author runs on a suite).

`list` shows every installed plug-in: one that fails to import or to build is a row of its
own saying why, the others are listed as usual, and the exit code is 1 (0 when every
plug-in loads), so a script or CI job sees a broken install without losing the list. An
unknown NAME is bad input: one line, exit 2, as everywhere in the CLI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ratchet.cli.common import console, guard, load

suites_app = typer.Typer(
    help="Task suites (plug-ins under the 'ratchet.suites' entry point group).", no_args_is_help=True
)


def _size(n: int | None) -> str:
    return "generated" if n is None else f"{n:,}"


@suites_app.command("list")
def suites_list(
    name: Annotated[str | None, typer.Argument(help="only this suite")] = None,
) -> None:
    """List installed suites, every subset of each (* = a default), and its split sizes.
    A plug-in that fails to load is one row saying why; the exit code is then 1."""
    with guard():
        from ratchet.suites.registry import available_suites, failure_line, get_suite

        table = Table("suite", "subset", "train", "dev", "test")
        table.columns[1].overflow = "fold"  # an error row is read whole, never cut with '…'
        found = available_suites()
        if name is not None and name not in found:
            get_suite(name)  # raises: an unknown name is one line with the installed ones
        names = sorted(found) if name is None else [name]
        about, broken = [], []
        for suite_name in names:
            try:
                rows, line = _rows(suite_name, found[suite_name].value)
            except Exception as exc:  # noqa: BLE001 - a broken plug-in is a row, not the end of the list
                why = failure_line(exc)
                table.add_row(suite_name, escape(f"error: {why}"), "—", "—", "—")
                broken.append(suite_name)
                continue
            for i, row in enumerate(rows):
                table.add_row(suite_name if i == 0 else "", *row)
            about.append(line)
        console.print(table)
        console.print("* a default subset ('-s NAME' takes these; '-s NAME:a,b' picks others)")
        for line in about:
            console.print(escape(line), highlight=False)
        if broken:
            console.print(
                f"{len(broken)} of {len(names)} suite plug-ins failed to load ({', '.join(broken)}): "
                "fix or reinstall them; a plug-in written for the first suite contract: "
                "docs/extending.md, 'Porting a plug-in from the first contract'",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1)


def _rows(suite_name: str, target: str) -> tuple[list[tuple[str, ...]], str]:
    """A suite's table rows (subset and split sizes) and its line below the table."""
    from ratchet.suites.registry import get_suite

    suite = get_suite(suite_name)
    try:
        rows = []
        for subset in suite.available_subsets():
            sizes = suite.split_sizes(subset)
            mark = " *" if subset in suite.default_subsets else ""
            rows.append((subset + mark, *(_size(sizes[s]) for s in ("train", "dev", "test"))))
        return rows, f"{suite_name}: version {suite.version}, plug-in {target}"
    finally:
        suite.close()


@suites_app.command("check")
def suites_check(
    spec: Annotated[str, typer.Argument(help="suite spec: 'name' or 'name:subset,subset'")],
    tasks: Annotated[int, typer.Option(help="tasks of each subset and split to look at")] = 3,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="count reply tokens with this tokenizer (a directory or name for transformers), "
            "for a suite served by another model; default: the shipped model's"
        ),
    ] = None,
) -> None:
    """Run the conformance kit on a suite: one line per promise of the suite contract (exit 1
    if one is broken). The output budget is checked against the model.max_tokens setting
    where a task sets none."""
    with guard():
        settings = load()
        from ratchet.conformance import check_suite
        from ratchet.server.weights import BASE_MODEL_NAME
        from ratchet.suites import get_suite

        copy = settings.models_dir / BASE_MODEL_NAME  # the shipped model's tokenizer, converted
        counted_by: str | Path | None = tokenizer or (copy if (copy / "tokenizer.json").is_file() else None)
        suite = get_suite(spec)
        try:
            suite.check()
            results = check_suite(suite, tasks, tokenizer=counted_by, max_tokens=settings.model.max_tokens)
        finally:
            suite.close()
        for r in results:
            mark = "[yellow]skip[/]" if r.skipped else "[green]ok[/]  " if r.ok else "[red]FAIL[/]"
            console.print(f"{mark} {r.name}: {escape(r.detail)}", highlight=False, soft_wrap=True)
        failed = [r.name for r in results if not r.ok]
        if failed:
            console.print(f"[red]{len(failed)} of {len(results)} checks failed[/]")
            raise typer.Exit(1)
        skipped = sum(r.skipped for r in results)
        if skipped:
            kept = len(results) - skipped
            console.print(
                f"[green]{spec} keeps the {kept} promises checked here[/] ({skipped} skipped: see above)"
            )
        else:
            console.print(f"[green]{spec} keeps all {len(results)} promises of the suite contract[/]")
