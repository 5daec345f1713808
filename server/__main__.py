"""`python -m ratchet.server`: run the embedded model server in the foreground (what `ratchet serve` runs)."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ratchet.server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--models-dir", type=Path, required=True)
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="the only tree adapters are loaded from, and where the admin token's file goes "
        "(default: the models dir's parent)",
    )
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=int(os.environ.get("RATCHET_SERVER_THREADS", "2")))
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=None,
        help="memory for keys and values, the running requests' and earlier prompts', in MiB (default 384; "
        "more only while running requests alone need it; 0: no prefix caching)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "auto", "bfloat16"],
        default="auto",
        help="the model's number format; auto: bfloat16 where the CPU has native bf16 units",
    )
    p.add_argument(
        "--keep-freed",
        action="store_true",
        help="keep freed memory mapped when idle (default: given back to the OS after 0.5 s idle)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="query tokens per prefill forward; longer prefills run in chunks (default 1024; 0: one forward)",
    )
    p.add_argument(
        "--shape-buckets",
        type=int,
        default=None,
        help="prefill widths padded to this many sizes per power of two (default: 4 in bfloat16, "
        "where each distinct shape holds memory; 0 in float32, where it would only cost time)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="the number format keys and values are stored in (auto: float16 under a float32 model, "
        "else the model's own)",
    )
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    args = p.parse_args(argv)
    if args.parent_pid:
        _exit_with_parent(args.parent_pid)

    _skip_unused_imports()
    from ratchet.server.launcher import TOKEN_ENV, check_port_free, remove_token_file, write_token_file

    try:
        check_port_free(args.host, args.port)
    except Exception as exc:  # PortInUseError: one line, non-zero exit
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import torch
    import uvicorn

    from ratchet.server.app import create_app
    from ratchet.server.engine import Engine
    from ratchet.server.precision import resolve
    from ratchet.server.weights import BASE_MODEL_NAME, ensure_hf_copy

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(
        ensure_hf_copy(args.models_dir),
        max_batch=args.max_batch,
        **({} if args.prefix_cache_mb is None else {"prefix_cache_bytes": args.prefix_cache_mb * 2**20}),
        dtype=resolve(args.dtype),
        **({"release_idle_s": None} if args.keep_freed else {}),
        **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}),
        **({} if args.shape_buckets is None else {"shape_buckets": args.shape_buckets}),
        **({} if args.kv_dtype == "auto" else {"kv_dtype": getattr(torch, args.kv_dtype)}),
    )
    data_dir = (args.data_dir or args.models_dir.resolve().parent).resolve()
    # the launcher's token (never in argv: every local user can read that), or, started by
    # hand (`ratchet serve`), a new one; this user's other processes read it from its file
    token = os.environ.pop(TOKEN_ENV, "") or secrets.token_urlsafe(32)
    written = write_token_file(data_dir, args.port, token)
    app = create_app(engine, BASE_MODEL_NAME, token=token, data_dir=data_dir)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()
        remove_token_file(written, token)
    return 0


# Packages installed beside the server that its imports load and it never calls: torch's
# compiler stack imports triton (a GPU kernel compiler, there because xgrammar depends on it)
# to ask whether it is there, and transformers imports scipy for its object-detection losses.
# Loading them maps ~140 MB of their libraries into every server process (bench/RESULTS.md,
# "server_memory, imports the server never uses"). Both callers check with find_spec, which
# answers "not installed" for a name set to None in sys.modules.
UNUSED_IMPORTS = ("triton", "scipy")


def _skip_unused_imports() -> None:
    """Make `UNUSED_IMPORTS` look absent to this process (call before importing torch)."""
    for name in UNUSED_IMPORTS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def _exit_with_parent(pid: int) -> None:
    """An embedded server must not outlive the ratchet process that started it (even on kill -9)."""
    import threading
    import time

    def watch() -> None:
        while True:
            time.sleep(2)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
