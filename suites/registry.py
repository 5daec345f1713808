"""Find suites through the `ratchet.suites` entry-point group, so third parties can add one."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from ratchet.errors import UnknownSuiteError
from ratchet.suites.base import Suite

GROUP = "ratchet.suites"


def available_suites() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def parse_suite_spec(spec: str) -> tuple[str, list[str] | None]:
    """'name' or 'name:subset,subset' -> (name, subsets or None for the suite's defaults)."""
    name, _, rest = spec.strip().partition(":")
    subsets = [s.strip() for s in rest.split(",") if s.strip()] or None
    return name, subsets


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
    try:
        cls = found[name].load()
    except Exception as exc:  # noqa: BLE001 - a broken plug-in is the user's to fix, in one line
        raise UnknownSuiteError(
            f"suite plug-in {name!r} failed to import: {exc}", "fix or reinstall it"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Suite)):
        raise UnknownSuiteError(f"entry point {name!r} is not a ratchet Suite", "fix the plug-in")
    return cls(subsets)
