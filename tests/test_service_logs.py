"""Prefect's and MLflow's own INFO lines: in the data dir's logs, never on the console."""

from __future__ import annotations

import logging
import sys

from ratchet.flows.service_logs import FILE, keep_service_logs


def test_service_info_goes_to_the_file_and_only_warnings_to_the_console(tmp_path, capsys) -> None:
    console = logging.StreamHandler(sys.stderr)  # a console handler as Prefect's and MLflow's are
    mlflow_logger = logging.getLogger("mlflow")
    mlflow_logger.addHandler(console)
    root = logging.getLogger()
    try:
        path = keep_service_logs(tmp_path / "logs")
        again = keep_service_logs(tmp_path / "logs")  # idempotent: one handler, one line per record
        logging.getLogger("prefect.flow_runs").info("Finished in state Completed()")
        logging.getLogger("mlflow.store").info("Creating initial MLflow database tables...")
        logging.getLogger("mlflow").warning("a real problem")
        logging.getLogger("ratchet.unrelated").info("not a service: not kept")
        for h in root.handlers:
            h.flush()
        text = path.read_text()
    finally:
        mlflow_logger.removeHandler(console)
        for logger in (root, mlflow_logger):
            for h in [h for h in logger.handlers if getattr(h, "baseFilename", "").endswith(FILE)]:
                logger.removeHandler(h)
                h.close()
    assert again == path == (tmp_path / "logs" / FILE).resolve()
    assert text.count("Finished in state Completed()") == 1, text
    assert text.count("Creating initial MLflow database tables") == 1, text
    assert "a real problem" in text and "not a service" not in text
    err = capsys.readouterr().err
    assert "a real problem" in err and "Completed()" not in err and "Creating initial" not in err
