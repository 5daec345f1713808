"""The README's run command, as a new user runs it: `ratchet evolve` from fresh data dirs.

Each round starts `.venv/bin/ratchet evolve` (the README's second command, nothing added
but the data dir and, per `--dtypes`, `RATCHET_MODEL__DTYPE`) in a new process on a new data
dir, its output going to a file (not a terminal: the plain progress lines), and keeps:

* the wall time from process start to exit, and the exit code;
* the last generation's held-out result beside random's on the same tasks, the paired sign
  test's p-value, and whether it is above random (p ≤ 0.05), from the evolve journal;
* every generation's row (what was promoted, rejected, how long), and the table it printed;
* the embedded model server's peak resident memory (`server_peak_mb`, the kernel's
  high-water mark of the `ratchet.server` process the run started, read every 2 s).

dtypes alternate within each round, so both see the same machine. The data dir's models/
is the checkout's converted model, linked (converting it again is ~20 s of every run).

    .venv/bin/python -m bench readme_run [--rounds 3] [--dtypes bfloat16 float32] [--set KEY=VALUE ...]

Writes bench/results/NAME.json (default readme_run).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from bench.harness import ROOT, clean_env, evolve_outcome, fresh_data_dir, option, write_result
from ratchet.server.memory import resident_mb, server_pids


@dataclass
class Options:
    rounds: int = option(3, "fresh data dirs per dtype")
    dtypes: list[str] = option(["bfloat16", "float32"], "model.dtype of each run (auto: the CPU decides)")
    set: list[str] = option([], "extra settings, KEY=VALUE, as RATCHET_* variables (none: the README run)")
    keep: bool = option(False, "keep the data dirs (their paths are in the result)")
    name: str = option("readme_run", "result file name under bench/results")


def settings_of(dtype: str, overrides: list[str]) -> dict[str, str]:
    """The settings one run changes from the README's: its dtype, then `--set`'s KEY=VALUE."""
    out: dict[str, str] = {}
    for item in [f"model.dtype={dtype}", *overrides]:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes KEY=VALUE, not {item!r}")
        out[key] = value
    return out


def env_for(dtype: str, overrides: list[str]) -> dict[str, str]:
    """The environment of one run: this one, with the dtype and any overrides as RATCHET_* variables."""
    env = clean_env()
    for key, value in settings_of(dtype, overrides).items():
        env["RATCHET_" + key.upper().replace(".", "__")] = value
    return env


def watch_server_peak(run: subprocess.Popen[bytes], peak: list[int]) -> None:
    """Keep in `peak[0]` the largest high-water mark (MiB) of any server `run` started."""
    while run.poll() is None:
        for pid in server_pids("--parent-pid", str(run.pid)):
            peak[0] = max(peak[0], resident_mb(pid).get("peak_rss_mb", 0))
        time.sleep(2)


def one_run(dtype: str, overrides: list[str], keep: bool) -> dict[str, object]:
    data = fresh_data_dir(f"ratchet-readme-{dtype}-")
    log = data / "run.log"
    started = time.monotonic()
    peak = [0]
    with log.open("w") as out:
        run = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "ratchet"), "--data-dir", str(data), "evolve"],
            cwd=ROOT,
            env=env_for(dtype, overrides),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        watcher = threading.Thread(target=watch_server_peak, args=(run, peak), daemon=True)
        watcher.start()
        code = run.wait()
        watcher.join()
    wall = time.monotonic() - started
    result = {
        "dtype": dtype,
        **evolve_outcome(data, settings_of(dtype, overrides), code, wall, log.read_text()),
        "server_peak_mb": peak[0] or None,  # None: no server seen (an endpoint, or it never started)
    }
    result["data_dir"] = str(data) if keep else None
    if not keep:
        shutil.rmtree(data, ignore_errors=True)
    return result


def run(opts: Options) -> int:
    runs: list[dict[str, object]] = []
    for r in range(opts.rounds):
        for dtype in opts.dtypes:
            one = one_run(dtype, opts.set, opts.keep)
            runs.append({"round": r, **one})
            print(
                f"round {r} {dtype}: {one['wall_minutes']} min, exit {one['exit_code']}, test {one['test']}, "
                f"random {one['random']}, p = {one['vs_random_p']}, promoted {one['promoted']}, "
                f"server peak {one['server_peak_mb']} MiB",
                flush=True,
            )
    summary = {}
    for dtype in opts.dtypes:
        mine = [x for x in runs if x["dtype"] == dtype]
        summary[dtype] = {
            "runs": len(mine),
            "above_random": sum(bool(x["above_random"]) for x in mine),
            "median_minutes": statistics.median(float(x["wall_minutes"]) for x in mine),  # type: ignore[arg-type]
            "max_minutes": max(float(x["wall_minutes"]) for x in mine),  # type: ignore[arg-type]
            "max_server_peak_mb": max((int(x["server_peak_mb"] or 0) for x in mine), default=0),  # type: ignore[call-overload]
        }
        print(f"{dtype}: above random in {summary[dtype]['above_random']} of {len(mine)}, {summary[dtype]}")
    write_result(opts.name, {"python": sys.version.split()[0], "summary": summary, "runs": runs}, opts)
    return 0 if all(x["exit_code"] == 0 for x in runs) else 1
