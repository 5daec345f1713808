"""MLflow's import-hook finder, made to take its lock only for the modules it hooks.

MLflow puts one finder first on `sys.meta_path` (`mlflow.utils.import_hooks.ImportHookFinder`)
and runs every `find_spec` under its hook lock, for every module any thread imports. Python
calls finders while holding its global import lock, so a thread importing anything takes
Python's lock, then MLflow's. MLflow takes them the other way round whenever a post-import
hook fires: it holds its hook lock while the hook runs, and a hook imports (registering
MLflow's model evaluators imports scikit-learn: seconds of imports under that lock). A thread
of Prefect importing a module for the first time meanwhile (its events client loads anyio's
asyncio backend) deadlocks the process: each holds the lock the other waits for. A benchmark's
evolve hung that way at its first stage, twice in a row.

The finder only acts on modules it has hooks for; for any other it returns None. That answer
needs no lock, so `guard()` answers it without one: a thread importing an unhooked module
never waits for a hook to finish. Modules MLflow hooks (the integrations it patches) still
go through the locked path, as MLflow wrote it.
"""

from __future__ import annotations

import functools
from typing import Any

from mlflow.utils import import_hooks

_GUARDED = "_ratchet_unhooked_without_lock"


def _hooked(fullname: str) -> bool:
    # two dict reads: atomic under the GIL, as MLflow's own check inside its lock reads them
    return fullname in import_hooks._post_import_hooks or fullname in import_hooks._import_error_hooks


def guard() -> None:
    """Patch `ImportHookFinder.find_spec`/`find_module` once per process (idempotent)."""
    finder = import_hooks.ImportHookFinder
    if getattr(finder, _GUARDED, False):
        return
    for name in ("find_spec", "find_module"):
        locked = getattr(finder, name, None)
        if locked is None:
            continue

        @functools.wraps(locked)
        def unlocked_when_unhooked(
            self: Any, fullname: str, *args: Any, _locked: Any = locked, **kw: Any
        ) -> Any:
            if not _hooked(fullname):
                return None
            return _locked(self, fullname, *args, **kw)

        setattr(finder, name, unlocked_when_unhooked)
    setattr(finder, _GUARDED, True)


guard()
