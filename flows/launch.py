"""Call a flow with the task runner the settings choose (threads by default).

Only the rollout flows (explore, evaluate, verify) go to a Dask or Ray cluster: rollouts
are many, independent and take a picklable `RuntimeRef`; the teacher's diagnose and
distill calls hold LangGraph graphs and stay on threads."""

from __future__ import annotations

import os
from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from ratchet.config import Settings
from ratchet.errors import ConfigError

ROLLOUT_FLOWS = frozenset({"explore", "evaluate", "verify"})


def task_runner(settings: Settings, flow_name: str = "explore") -> Any:
    """Threads (`concurrency` workers), or for a rollout flow a Dask or Ray runner when
    `evolve.task_runner` says so."""
    kind = settings.evolve.task_runner
    if kind == "threads" or flow_name not in ROLLOUT_FLOWS:
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
    # ephemeral mode's API lives in this process only
    prefect_server_url(f"evolve.task_runner = {kind!r} needs a Prefect server its worker processes can reach")
    workers = settings.evolve.workers
    if kind == "dask":
        return DaskTaskRunner(
            cluster_kwargs={"n_workers": workers or 2, "threads_per_worker": settings.concurrency}
        )
    return RayTaskRunner(init_kwargs={"num_cpus": workers or 2, "include_dashboard": False})


def prefect_server_url(problem: str) -> str:
    """PREFECT_API_URL, or one clear error saying `problem` and how to start a server."""
    url = os.environ.get("PREFECT_API_URL", "")
    if not url:
        raise ConfigError(
            problem,
            "start one (prefect server start --host 127.0.0.1) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api",
        )
    return url


def run_flow(flow_obj: Any, settings: Settings, **kwargs: Any) -> Any:
    runner = task_runner(settings, flow_obj.name)
    return flow_obj.with_options(task_runner=runner)(settings=settings, **kwargs)
