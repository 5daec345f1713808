"""The first flow run in a new data dir, on a busy machine: Prefect's default start vs ratchet's.

Each round, for each mode, a fresh Prefect home (no database yet) and a fresh process that
runs one trivial flow, while `--busy` processes spin on the cores:

* `prefect-default`: the flow call starts Prefect's ephemeral API server itself, with
  Prefect's own start-up limit (20 s), as ratchet did before it started the server itself;
* `ratchet`: `ratchet.flows.prefect_api.start_prefect_api()` first (the CLI's path: the limit
  from `ratchet.runtime_env`), then the same flow.

Reports, per mode, how many first runs succeeded and their wall time (process start to
flow result). Modes alternate within each round, so both see the same load.

    .venv/bin/python -m bench first_run [--rounds 4] [--busy 4]

Writes bench/results/first_run.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from bench.harness import option, write_result

FLOW = """
import time
started = time.monotonic()
{prepare}
from prefect import flow

@flow
def first():
    return 1

assert first() == 1
print("ok", round(time.monotonic() - started, 1))
"""
PREPARE = {
    "prefect-default": "",
    "ratchet": "from ratchet.flows.prefect_api import start_prefect_api\nstart_prefect_api()",
}


def one_run(mode: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="ratchet-first-run-") as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env |= {
            "PREFECT_HOME": home,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "ERROR",
        }
        if mode == "ratchet":
            from ratchet.runtime_env import PREFECT_STARTUP_TIMEOUT_S

            env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = str(PREFECT_STARTUP_TIMEOUT_S)
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", FLOW.format(prepare=PREPARE[mode])],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        seconds = time.monotonic() - started
    ok = proc.returncode == 0 and "ok" in proc.stdout
    error = "" if ok else next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "")[:200]
    return {"mode": mode, "ok": ok, "seconds": round(seconds, 1), "error": error}


@dataclass
class Options:
    rounds: int = option(4)
    busy: int = option(2 * (os.cpu_count() or 2), "spinning processes")


def run(args: Options) -> None:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs = []
    try:
        for r in range(args.rounds):
            modes = list(PREPARE) if r % 2 == 0 else list(reversed(PREPARE))
            for mode in modes:
                runs.append(one_run(mode) | {"round": r})
                print(json.dumps(runs[-1]), flush=True)
    finally:
        for s in spinners:
            s.kill()
    load = f"{args.busy} busy processes on {os.cpu_count()} cores"
    print(f"\n| mode | first runs that worked ({load}) | wall s (median) |")
    print("|---|---|---|")
    summary = {}
    for mode in PREPARE:
        mine = [x for x in runs if x["mode"] == mode]
        good = [float(x["seconds"]) for x in mine if x["ok"]]
        summary[mode] = {
            "ok": len(good),
            "runs": len(mine),
            "median_s": statistics.median(good) if good else None,
        }
        med = f"{statistics.median(good):.1f}" if good else "—"
        print(f"| {mode} | {len(good)}/{len(mine)} | {med} |")
    write_result("first_run", {"summary": summary, "runs": runs}, args)
