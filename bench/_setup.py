"""What several benchmarks share: a fresh data dir whose model cache is the checkout's own."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def bench_settings(prefix: str, **overrides: Any) -> Any:
    """Settings on a new temporary data dir, its environment prepared; the converted model of
    an earlier run or test session is linked in instead of converted again (~20 s)."""
    from ratchet.config import load_settings
    from ratchet.runtime_env import prepare_environment

    data = Path(tempfile.mkdtemp(prefix=prefix))
    settings = load_settings({"data_dir": data, **overrides})
    for shared in (ROOT / ".ratchet" / "models", ROOT / ".ratchet" / "test-models"):
        if shared.exists():
            settings.models_dir.parent.mkdir(parents=True, exist_ok=True)
            settings.models_dir.symlink_to(shared, target_is_directory=True)
            break
    prepare_environment(settings)
    return settings


def write_result(name: str, summary: dict[str, Any], kept: dict[str, Any] | None = None) -> None:
    """Print a benchmark's summary and keep it, with `kept` (its arguments, every run), as
    bench/results/<name>.json."""
    import json

    print(json.dumps(summary, indent=2))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({**(kept or {}), **summary}, indent=2))
