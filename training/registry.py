"""Adapters as MLflow registered model versions; the alias `champion` is the live one."""

from __future__ import annotations

import hashlib
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_sha256(adapter_dir: Path) -> str:
    """sha256 over the files that define an adapter (config and weights), in a fixed order."""
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        path = adapter_dir / name
        h.update(name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
