"""Run by tests/test_hang.py in a child process (a deadlock must not wedge pytest's own):
the loop's gate evaluations against MLflow's trace exporter, in the lock order that hung a
run. Prints OK or DEADLOCK on stderr and exits 0 or 1.

    python -m tests.mlflow_threads_probe order DATA_DIR   # the reported interleaving, forced
    python -m tests.mlflow_threads_probe stress DATA_DIR N   # N gate evaluations while traces export
"""

from __future__ import annotations

import _imp
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlflow

from ratchet.config import load_settings
from ratchet.flows import evaluations, tracking
from ratchet.runtime_env import prepare_environment

# A gate evaluation takes about a second, and on a busy machine with traces exporting into
# the same sqlite file up to a minute: stuck is no evaluation finished for this long.
JOIN_S = float(os.environ.get("PROBE_JOIN_S", 240))
_progress = [time.monotonic()]


def _gate(settings: Any, name: str) -> None:
    pairs = [("t1", False, True), ("t2", True, True), ("t3", True, False)]
    evaluations.gate(settings, 1, name, "rule", "all", "rejected", {"pairs": pairs, "decision": "reject"})


def order(settings: Any) -> threading.Thread:
    """The hang's stack dump, made to happen: the loop's thread inside MLflow's hook lock
    (a post-import hook running) while the exporter's thread holds Python's import lock and
    asks for the hook lock, as MLflow's import finder does for a lazy import."""
    in_hook, exporter_has_import_lock = threading.Event(), threading.Event()

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "_setup_autolog" and not in_hook.is_set():
            in_hook.set()
            exporter_has_import_lock.wait(30)

    def exporter() -> None:
        if not in_hook.wait(JOIN_S):
            return
        _imp.acquire_lock()
        exporter_has_import_lock.set()
        try:
            from mlflow.utils.import_hooks import get_post_import_hooks

            get_post_import_hooks("IPython")
        finally:
            _imp.release_lock()

    def loop() -> None:
        sys.settrace(tracer)
        with tracking.generation_run(settings, 1):
            _gate(settings, "forced-order")
        sys.settrace(None)

    threading.Thread(target=exporter, daemon=True).start()
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def stress(settings: Any, n: int) -> threading.Thread:
    """`n` gate evaluations on the loop's thread while another thread keeps finishing traces
    (so the exporter ships them) and a third keeps importing a missing module, which takes
    Python's import lock and then MLflow's finder's."""
    stop = threading.Event()

    def traced() -> None:
        i = 0
        while not stop.is_set():
            with mlflow.tracing.context(enabled=True), mlflow.start_span(name=f"rollout {i}") as span:
                span.set_inputs({"i": i})
            stop.wait(0.2)  # an explore's pace: traces finish a few a second
            i += 1

    def importer() -> None:
        while not stop.is_set():
            try:
                __import__("IPython_is_not_installed_here")
            except ImportError:
                pass

    def loop() -> None:
        try:
            with tracking.generation_run(settings, 1):
                for i in range(n):
                    _gate(settings, f"stress-{i}")
                    _progress[0] = time.monotonic()
        finally:
            stop.set()

    for fn in (traced, importer):
        threading.Thread(target=fn, daemon=True).start()
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def main() -> None:
    mode, data = sys.argv[1], Path(sys.argv[2])
    settings = load_settings({"data_dir": str(data)})
    prepare_environment(settings)
    t = order(settings) if mode == "order" else stress(settings, int(sys.argv[3]))
    while t.is_alive() and time.monotonic() - _progress[0] < JOIN_S:
        t.join(1.0)
    # evaluate swaps sys.stdout for a buffer while it runs: write to the real fd
    if t.is_alive():
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    os.write(2, b"DEADLOCK\n" if t.is_alive() else b"OK\n")
    os._exit(1 if t.is_alive() else 0)


if __name__ == "__main__":
    main()
