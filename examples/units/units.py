"""Unit conversion: the table the agents' `convert` tool and the task generator share."""

from __future__ import annotations

# unit -> (dimension, size in the dimension's base unit)
UNITS: dict[str, tuple[str, float]] = {
    "kilometer": ("length", 1000.0),
    "meter": ("length", 1.0),
    "centimeter": ("length", 0.01),
    "millimeter": ("length", 0.001),
    "mile": ("length", 1609.344),
    "foot": ("length", 0.3048),
    "inch": ("length", 0.0254),
    "kilogram": ("mass", 1000.0),
    "gram": ("mass", 1.0),
    "pound": ("mass", 453.59237),
    "ounce": ("mass", 28.349523125),
    "day": ("time", 86400.0),
    "hour": ("time", 3600.0),
    "minute": ("time", 60.0),
    "second": ("time", 1.0),
    "liter": ("volume", 1.0),
    "milliliter": ("volume", 0.001),
    "gallon": ("volume", 3.785411784),
}
PLURAL = {"foot": "feet", "inch": "inches"}
SHORT = {
    "kilometer": "km",
    "meter": "m",
    "centimeter": "cm",
    "millimeter": "mm",
    "kilogram": "kg",
    "gram": "g",
}


def plural(unit: str) -> str:
    return PLURAL.get(unit, unit + "s")


def unit_named(name: str) -> str | None:
    """The unit a word names: singular, plural, British spelling or short form."""
    word = name.strip().lower().replace("metre", "meter").replace("litre", "liter")
    for unit in UNITS:
        if word in (unit, plural(unit), SHORT.get(unit)):
            return unit
    return None


def convert(value: float, from_unit: str, to_unit: str) -> str:
    """`value` in `from_unit`, in `to_unit`, as a sentence; a refusal says why."""
    a, b = unit_named(from_unit), unit_named(to_unit)
    if a is None or b is None:
        return f"error: unknown unit {from_unit if a is None else to_unit!r}"
    if UNITS[a][0] != UNITS[b][0]:
        return f"error: cannot convert {UNITS[a][0]} ({a}) to {UNITS[b][0]} ({b})"
    result = float(value) * UNITS[a][1] / UNITS[b][1]
    return f"{value:g} {plural(a)} = {result:.6g} {plural(b)}"
