"""Call a flow with the task runner the settings choose (threads by default).

Only the rollout flows (explore, evaluate, verify) go to a Dask or Ray cluster: rollouts
are many, independent and take a picklable `RuntimeRef`; the teacher's diagnose and
distill calls hold LangGraph graphs and stay on threads."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import sys
import tempfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from ratchet.config import Settings
from ratchet.errors import ConfigError
from ratchet.flows.loop import distributed
from ratchet.runtime_env import prepare_environment

# A rollout whose Ray worker process died (killed, out of memory) is run again by Ray in
# another worker under the same Prefect task run; the slot's id and the store's upsert make
# the replay replace whatever the dead one stored. (Prefect's own retries are for exceptions
# raised inside a task: they die with the process.)
RAY_TASK_RETRIES = 3
# Ray's sockets live in <temp dir>/session_<date>_<time>_<us>_<pid>/sockets/ and AF_UNIX
# paths stop at 107 bytes: a longer temp dir than this does not fit.
RAY_TEMP_DIR_MAX = 40
# What rollouts pass is small (a ref, a slot, a state). Ray's default takes 30% of the
# machine's memory for its object store.
RAY_OBJECT_STORE_BYTES = 256 * 2**20
# Given to Ray's worker processes explicitly (they also inherit the flow process's
# environment); secrets stay out of Ray's job table and logs.
WORKER_ENV_PREFIXES = ("PREFECT_", "MLFLOW_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "RATCHET_")
WORKER_ENV_NAMES = frozenset({"ANONYMIZED_TELEMETRY", "DO_NOT_TRACK"})
SECRET_WORDS = frozenset({"KEY", "TOKEN", "SECRET", "PASSWORD"})  # words of a variable's name
RAY_TOKEN = secrets.token_hex(32)  # this process's clusters' (launch.py:ray_environment)


def task_runner(settings: Settings, flow_name: str = "explore") -> Any:
    """Threads (`concurrency` workers), or for a stage whose rollouts are `distributed`
    (`flows/loop.py`) a Dask or Ray runner when `evolve.task_runner` says so."""
    kind = settings.evolve.task_runner
    if kind == "threads" or not distributed(flow_name):
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
    api = prefect_server_url(
        f"evolve.task_runner = {kind!r} needs a Prefect server its worker processes can reach",
        flows_api_url(),
    )
    workers = settings.evolve.workers
    if kind == "dask":
        return DaskTaskRunner(
            cluster_kwargs={"n_workers": workers or 2, "threads_per_worker": settings.concurrency}
        )
    return RayTaskRunner(init_kwargs=ray_init_kwargs(settings, api))


def ray_init_kwargs(settings: Settings, api_url: str) -> dict[str, Any]:
    """`ray.init` for one flow run: a cluster of this machine only, started by the flow's
    task runner and shut down when the flow ends (prefect-ray does both), with
    `evolve.workers` worker processes (default 2) that play one rollout each at a time.

    No dashboard, nothing but 127.0.0.1, no usage stats, a token no other local user
    has; its sockets, logs and spilled objects under `ray_temp_dir`. Its worker processes
    report to `api_url`, the flow's Prefect server."""
    prepare_environment(settings)  # before Ray starts: its worker processes inherit it
    ray_environment()
    worker_env = {
        k: v
        for k, v in os.environ.items()
        if (k.startswith(WORKER_ENV_PREFIXES) or k in WORKER_ENV_NAMES)
        and not SECRET_WORDS & set(k.split("_"))
    }
    worker_env["PREFECT_API_URL"] = api_url
    return {
        "num_cpus": settings.evolve.workers or 2,
        "include_dashboard": False,  # Ray still starts its API server, bound to 127.0.0.1 without the UI
        "object_store_memory": RAY_OBJECT_STORE_BYTES,
        "_temp_dir": str(ray_temp_dir(settings)),
        "runtime_env": {"env_vars": worker_env},
        "log_to_driver": False,  # workers' output stays in the session's logs/, not across the progress bars
        "logging_level": logging.WARNING,
    }


def ray_environment() -> None:
    """What Ray reads from the environment, in this process and the ones it starts."""
    # Despite its name, "0" makes Ray a single-node cluster on 127.0.0.1: every server binds
    # the loopback address, none the machine's network address (Ray's default on Linux).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # Ray was imported before: it read the variable then
        constants.ENABLE_RAY_CLUSTER = False
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray's own default writes a token to ~/.ray; one for this process is enough (it must stay
    # the same: Ray's client keeps the first it read, and every flow starts a new cluster).
    mode = os.environ.setdefault("RAY_AUTH_MODE", "token")
    if mode == "token" and "RAY_AUTH_TOKEN_PATH" not in os.environ:
        os.environ.setdefault("RAY_AUTH_TOKEN", RAY_TOKEN)


def ray_temp_dir(settings: Settings) -> Path:
    """`<data dir>/ray`, or where that path is too long for Ray's sockets a short folder of
    the system's temp dir, one per data dir. Each flow run adds a session folder (logs in
    `session_*/logs`; `session_latest` is the last)."""
    own = (settings.data_dir / "ray").resolve()
    if len(str(own)) <= RAY_TEMP_DIR_MAX:
        return own
    digest = hashlib.sha256(str(own).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"ratchet-ray-{digest}"


def flows_api_url() -> str:
    """The Prefect API this process's flows report to ('' in ephemeral mode). Prefect reads
    PREFECT_API_URL when it is imported: set later, it reaches processes started later
    (worker processes inherit it) but not this process's flows."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or ""


def prefect_server_url(problem: str, url: str | None = None) -> str:
    """`url` (default: PREFECT_API_URL), or one clear error saying `problem` and how to start
    a server."""
    url = os.environ.get("PREFECT_API_URL", "") if url is None else url
    if not url:
        raise ConfigError(
            problem,
            "start one (prefect server start --host 127.0.0.1) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api",
        )
    return url


def run_flow(flow_obj: Any, settings: Settings, **kwargs: Any) -> Any:
    runner = task_runner(settings, flow_obj.name)
    with task_options(runner):
        return flow_obj.with_options(task_runner=runner)(settings=settings, **kwargs)


def task_options(runner: Any) -> AbstractContextManager[Any]:
    """For Ray: every task the flow submits is retried when its worker process dies."""
    if type(runner).__module__.startswith("prefect_ray"):
        from prefect_ray.context import remote_options

        return remote_options(max_retries=RAY_TASK_RETRIES)
    return nullcontext()
