"""Call a flow with the task runner the settings choose (threads by default)."""

from __future__ import annotations

from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from ratchet.config import Settings
from ratchet.errors import ConfigError


def task_runner(settings: Settings) -> Any:
    """Threads (`concurrency` workers), or a Dask or Ray runner when `evolve.task_runner` says so."""
    kind = settings.evolve.task_runner
    if kind == "threads":
        return ThreadPoolTaskRunner(max_workers=settings.concurrency)
    try:
        if kind == "dask":
            from prefect_dask import DaskTaskRunner
        else:
            from prefect_ray import RayTaskRunner
    except ImportError:
        raise ConfigError(
            f"evolve.task_runner = {kind!r} needs the {kind} extra",
            f"install it: .venv/bin/pip install -e '.[{kind}]'",
        ) from None
    workers = settings.evolve.workers
    if kind == "dask":
        return DaskTaskRunner(
            cluster_kwargs={"n_workers": workers or 2, "threads_per_worker": settings.concurrency}
        )
    return RayTaskRunner(init_kwargs={"num_cpus": workers or 2, "include_dashboard": False})


def run_flow(flow_obj: Any, settings: Settings, **kwargs: Any) -> Any:
    return flow_obj.with_options(task_runner=task_runner(settings))(settings=settings, **kwargs)
