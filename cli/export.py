"""`ratchet export DIR`: the live champion as plain files a user applies without ratchet
(`flows/export.py`)."""

from __future__ import annotations

import getpass
import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from ratchet.cli.common import GLOBAL, console, err, guard


def export(
    out: Annotated[Path, typer.Argument(help="directory to write (new, or empty unless --force)")],
    force: Annotated[bool, typer.Option("--force", help="replace a directory that holds files")] = False,
) -> None:
    """Export the champion of the evolution (--evolution, --data-dir) as plain files: the
    system-message addition, the tool-schema changes, the LoRA adapter, the MCP tools' command,
    a manifest with each candidate's gate evidence, and apply.py, which applies them to an
    OpenAI chat-completions request without ratchet. Written whole or not at all."""
    with guard():
        from ratchet.config import load_settings
        from ratchet.runtime_env import offline_environment

        # the settings a run reads, without preparing the data dir: an export writes nothing there
        flat = {k: v for k, v in GLOBAL.items() if k != "config"}
        settings = load_settings(flat, config_file=GLOBAL.get("config"))
        offline_environment()
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the embedding model's loading bar
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        for noisy in ("mlflow", "alembic", "httpx"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        from ratchet.flows.export import export_champion

        with err.status(f"exporting the champion of {settings.evolution!r}"):
            result = export_champion(settings, out, force=force, by=getpass.getuser())
        console.print(
            f"exported policy {result.policy_version} ({', '.join(result.candidates)}) to {result.path}: "
            f"{len(result.files)} files; see its README.md",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
