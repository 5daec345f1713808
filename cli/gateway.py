"""`ratchet gateway`: the live champion, served to your own agent."""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from typing import Annotated

import typer

from ratchet.cli.common import console, err, guard, load

DEFAULT_PORT = 8790


def gateway(
    port: Annotated[int, typer.Option(help="port to listen on")] = DEFAULT_PORT,
    host: Annotated[
        str, typer.Option(help="address to bind; beyond loopback every request needs the gateway token")
    ] = "127.0.0.1",
    endpoint: Annotated[
        str | None,
        typer.Option(help="OpenAI-compatible base URL to serve from (default: the embedded model)"),
    ] = None,
    allow_base: Annotated[
        bool, typer.Option("--allow-base", help="start even when nothing is promoted (each answer says so)")
    ] = False,
    poll: Annotated[float, typer.Option(min=0.05, help="seconds between looks at the audit logs")] = 0.5,
    temperature: Annotated[
        float | None,
        typer.Option(
            min=0.0, max=2.0, help="every request's temperature (default: the agent's own; 0: greedy)"
        ),
    ] = None,
    record: Annotated[
        bool,
        typer.Option(
            help="every completion an MLflow trace in the evolution's experiment (X-Ratchet-Trace), "
            "feedback taken on POST /v1/feedback; --no-record: neither"
        ),
    ] = True,
) -> None:
    """Serve the live champion of the evolution (--evolution, --data-dir) to your own agent: an
    OpenAI-compatible API (…/v1: chat completions with tools and streaming, models) that applies
    the promoted skills, rules, argument constraints, exemplars and adapter to every call, with the
    promoted function tools over MCP at /mcp. Every answer names its policy version
    (X-Ratchet-Policy, system_fingerprint). A promotion or rollback from anywhere is served within
    seconds, without a restart. Every completion is an MLflow trace that feedback can be given on
    (POST /v1/feedback, with the token). Starts the embedded model server unless --endpoint names one."""
    with guard():
        settings = load(**{"model.endpoint": endpoint})
        from ratchet.flows.runtime import model_endpoint
        from ratchet.gateway.guard import token_path
        from ratchet.gateway.policy import has_champion
        from ratchet.gateway.serve import Gateway, NoChampion, is_loopback
        from ratchet.server.launcher import check_port_free

        check_port_free(host, port, "pass --port with another port")
        if not allow_base and not has_champion(settings):  # before a model server is started for nothing
            raise NoChampion(
                f"evolution {settings.evolution!r} in {settings.data_dir} has no champion (none promoted)",
                "promote a candidate, or pass --allow-base to serve the base model (each answer says so)",
            )
        _log_to_stderr()
        import torch

        # the gateway embeds one short query per task (to choose its skills): one core does it
        # in milliseconds, and the model server beside it keeps the others
        torch.set_num_threads(1)
        with ExitStack() as stack:
            with err.status("starting the model server and reading the champion"):
                upstream = stack.enter_context(model_endpoint(settings))
                gw = stack.enter_context(
                    Gateway(
                        settings,
                        upstream,
                        host,
                        port,
                        allow_base,
                        poll,
                        temperature=temperature,
                        record=record,
                    )
                )
            snap, root = gw.snapshot, gw.url.removesuffix("/v1")
            console.print(f"gateway on {gw.url} (MCP: {root}/mcp) in front of {upstream}", soft_wrap=True)
            console.print(f"policy {snap.version}: {snap.describe()}", highlight=False)
            if not snap.champion:
                console.print(
                    "no champion: serving the base model, and every answer says so (X-Ratchet-Champion)"
                )
            if not is_loopback(host):
                where = token_path(settings.data_dir)
                console.print(f"every request needs `Authorization: Bearer` with the token in {where}")
            if record:
                console.print(
                    f"every answer is an MLflow trace in experiment ratchet-{settings.evolution} "
                    f"(X-Ratchet-Trace); feedback: POST {root}/v1/feedback with the token in "
                    f"{token_path(settings.data_dir)}",
                    soft_wrap=True,
                )
            console.print("promotions and rollbacks are served within seconds; Ctrl-C to stop")
            try:
                while gw.alive():
                    time.sleep(0.5)
            except KeyboardInterrupt:
                err.print("gateway stopping")


def _log_to_stderr() -> None:
    """The gateway's own lines (each swap, a reload that failed, refused clients) on stderr, timed."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    for name, level in (("ratchet.gateway", logging.INFO), ("ratchet.gateway.http", logging.WARNING)):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.addHandler(handler)
    logging.getLogger("ratchet.gateway").propagate = False
