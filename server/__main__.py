"""`python -m server`: run the embedded model server in the foreground (what `ratchet serve` runs)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--models-dir", type=Path, required=True)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=int(os.environ.get("RATCHET_SERVER_THREADS", "2")))
    args = p.parse_args(argv)

    from server.launcher import check_port_free

    try:
        check_port_free(args.host, args.port)
    except Exception as exc:  # PortInUseError: one line, non-zero exit
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch
    import uvicorn

    from server.app import create_app
    from server.engine import Engine
    from server.weights import BASE_MODEL_NAME, ensure_hf_copy

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(ensure_hf_copy(args.models_dir), max_batch=args.max_batch)
    app = create_app(engine, BASE_MODEL_NAME)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
