"""Find suites through the `ratchet.suites` entry-point group, so third parties can add one."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from ratchet.config import Settings
from ratchet.errors import RatchetError, UnknownSuiteError
from ratchet.suites.base import PORTING_NOTE, Suite

GROUP = "ratchet.suites"


def available_suites() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def parse_suite_spec(spec: str) -> tuple[str, list[str] | None]:
    """'name' or 'name:subset,subset' -> (name, subsets or None for the suite's defaults)."""
    name, _, rest = spec.strip().partition(":")
    subsets = [s.strip() for s in rest.split(",") if s.strip()] or None
    return name, subsets


def load_suite_class(name: str, entry: EntryPoint) -> type[Suite]:
    """The `Suite` subclass an entry point names; a plug-in that fails to import (or names
    something else) is one line, so a caller can report it and go on with the others."""
    try:
        cls = entry.load()
    except Exception as exc:  # noqa: BLE001 - a broken plug-in is the user's to fix, in one line
        problem = f"suite plug-in {name!r} failed to import: {one_line(exc)}"
        fix = "fix or reinstall it"
        if isinstance(exc, ImportError) and (exc.name or "").startswith("ratchet."):
            note = "" if PORTING_NOTE in problem else f" ({PORTING_NOTE})"
            fix = f"it imports what ratchet no longer has: port it to the current suite contract{note}"
        raise UnknownSuiteError(problem, fix) from None
    if not (isinstance(cls, type) and issubclass(cls, Suite)):
        raise UnknownSuiteError(f"entry point {name!r} is not a ratchet Suite", "fix the plug-in")
    return cls


def get_suite(spec: str) -> Suite:
    """Instantiate a suite by spec; an unknown name lists the installed ones."""
    name, subsets = parse_suite_spec(spec)
    found = available_suites()
    if name not in found:
        known = ", ".join(sorted(found)) or "none"
        raise UnknownSuiteError(
            f"unknown suite {name!r} (installed: {known})",
            "pick one of those, or install a package that registers it under 'ratchet.suites'",
        )
    return load_suite_class(name, found[name])(subsets)


def suite_from(settings: Settings) -> Suite:
    """The suite the settings name: the task file when `tasks.file` is set
    (`suites/task_file.py`), else the plug-in `suite` names."""
    if settings.tasks.file is not None:
        from ratchet.suites.task_file import TaskFileSuite  # noqa: PLC0415 - only for a task file

        learned = settings.traffic_file if settings.traffic.learn else None
        return TaskFileSuite(settings.tasks, learned=learned, share=settings.traffic.share)
    return get_suite(settings.suite)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a SyntaxError's, a traceback's, are several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def failure_line(exc: BaseException) -> str:
    """Why a suite failed to load or check, on one line: a RatchetError says it (with what to
    do); anything else is the plug-in's own bug, named by its type."""
    return str(exc) if isinstance(exc, RatchetError) else f"{type(exc).__name__}: {one_line(exc)}"
