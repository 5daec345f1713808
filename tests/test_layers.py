"""The layers, enforced: a module imports only from its own package and the layers below it.

Imports are read from the source (every `import` and `from ... import`, including the ones
inside functions), so a lazy import cannot hide an upward arrow. Bare top-level names of
ratchet's folders (`agents`, `memory`, ...) are refused everywhere: installed, they exist
only as `ratchet.agents`, `ratchet.memory`, ...
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top; packages on one line are siblings and may not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("ratchet",),  # the core: types, settings, errors
    ("suites", "server", "memory", "diagnosis"),
    ("skills",),
    ("agents",),
    # conformance: the kit plug-in authors run on their suites; endpoint: the intervention
    # endpoint in front of the model, and a user's own agent as the rollout
    ("training", "conformance", "endpoint"),
    ("flows",),
    # the gateway serves the live champion to a user's agent: a standing server, like the dashboard
    ("dashboard", "gateway"),
    ("cli",),
]
RANK = {package: i for i, names in enumerate(LAYERS) for package in names}
FOLDERS = tuple(RANK)


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _package_of(module: str) -> str | None:
    """'ratchet.flows.runtime' -> 'flows'; 'ratchet.types' -> 'ratchet'; anything else -> None."""
    parts = module.split(".")
    if parts[0] != "ratchet":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in RANK else "ratchet"


def _sources() -> list[tuple[str, Path]]:
    return [(folder, p) for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


def test_every_folder_of_the_project_is_in_a_layer() -> None:
    # bench/ is a package of the checkout (`python -m bench`), never installed: above every layer
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"bench"}
    assert packages == set(FOLDERS), "add the new package to LAYERS (and to pyproject's package-dir)"


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_imports_upward_or_sideways(folder: str) -> None:
    wrong = []
    for _, path in [s for s in _sources() if s[0] == folder]:
        for line, module in _imports(path):
            target = _package_of(module)
            if target is None or target == folder:
                continue
            if RANK[target] >= RANK[folder]:
                wrong.append(
                    f"{path.relative_to(ROOT)}:{line} imports {module} ({target} is not below {folder})"
                )
    assert not wrong, "\n".join(wrong)


def test_no_bare_top_level_names_anywhere() -> None:
    """`import agents` would find whatever else is installed under that name."""
    files = (
        [p for _, p in _sources()]
        + sorted((ROOT / "tests").glob("*.py"))
        + sorted((ROOT / "bench").glob("*.py"))
    )
    bare = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in _imports(path)
        if module.split(".")[0] in FOLDERS and module.split(".")[0] != "ratchet"
    ]
    assert not bare, "\n".join(bare)


def test_commands_that_need_no_model_never_load_torch() -> None:
    """`ratchet skills list` and its kind import the loop's runtime and the endpoint, never the
    engine: importing torch and transformers cost every such command 5 s (9.1 s -> 4.0 s)."""
    import subprocess
    import sys

    code = (
        "import sys, ratchet.cli.main, ratchet.flows.runtime, ratchet.endpoint.app, ratchet.endpoint.tools\n"
        "print(sorted(m for m in ('torch', 'transformers', 'xgrammar', 'peft', 'trl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
