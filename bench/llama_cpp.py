"""llama.cpp's own server, as a comparison anchor for the benches (never an install dependency).

    .venv/bin/python -m bench llama_cpp build     # fetch the sdist, compile llama-server (~10-20 min)
    .venv/bin/python -m bench llama_cpp serve     # serve the shipped GGUF on a free port until Ctrl-C

The source is the llama.cpp that the `llama-cpp-python` sdist vendors, fetched from the package
registry with `pip download` into `.ratchet/bench/` (the same registry the install uses, so it
works offline-from-the-internet). Only the `llama-server` target is built.

CPU flags: `GGML_NATIVE` is off because `-march=native` emits AMX instructions that some VMs
forbid (SIGILL). Instead the AVX-512 family is switched on exactly when /proc/cpuinfo lists it,
so the anchor uses the same vector units torch's kernels pick at run time on this machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness import ROOT, option
from ratchet.server.launcher import free_port
from ratchet.server.precision import cpu_flags
from ratchet.server.weights import BASE_MODEL_NAME, shipped_gguf

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is what we build
WORK = ROOT / ".ratchet" / "bench" / f"llama-cpp-python-{VERSION}"
SERVER_BIN = WORK / "build" / "bin" / "llama-server"


def cmake_flags() -> list[str]:
    """Portable flags plus the AVX-512 extensions this CPU has (never AMX)."""
    have = cpu_flags()
    on = {
        "GGML_NATIVE": False,
        "GGML_AVX": "avx" in have,
        "GGML_AVX2": "avx2" in have,
        "GGML_FMA": "fma" in have,
        "GGML_F16C": "f16c" in have,
        "GGML_BMI2": "bmi2" in have,
        "GGML_AVX512": "avx512f" in have,
        "GGML_AVX512_VBMI": "avx512vbmi" in have,
        "GGML_AVX512_VNNI": "avx512_vnni" in have,
        "GGML_AVX512_BF16": "avx512_bf16" in have,
        "LLAMA_CURL": False,
        "LLAMA_OPENSSL": False,
        "LLAMA_BUILD_TESTS": False,
        "LLAMA_BUILD_EXAMPLES": False,
        "GGML_BUILD_TESTS": False,
        "GGML_BUILD_EXAMPLES": False,
    }
    return [f"-D{k}={'ON' if v else 'OFF'}" for k, v in on.items()] + ["-DCMAKE_BUILD_TYPE=Release"]


def source_dir() -> Path:
    """The vendored llama.cpp tree, fetched and unpacked on first use."""
    src = WORK / "src"
    tree = src / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if tree.is_dir():
        return tree
    src.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"llama-cpp-python=={VERSION}",
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            str(src),
        ],
        check=True,
    )
    with tarfile.open(src / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
        tar.extractall(src, filter="data")
    return tree


def build() -> Path:
    if SERVER_BIN.exists():
        return SERVER_BIN
    tree = source_dir()
    build_dir = WORK / "build"
    subprocess.run(
        ["cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja", *cmake_flags()], check=True
    )
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", jobs], check=True)
    return SERVER_BIN


@contextlib.contextmanager
def llama_server(
    *,
    threads: int = 2,
    parallel: int = 8,
    ctx_per_slot: int = 2048,
    lora: Path | None = None,
    log: Path | None = None,
    start_timeout: float = 600.0,
) -> Iterator[str]:
    """Serve the shipped GGUF with llama-server; yields the OpenAI base URL (`.../v1`).

    `parallel` slots share one continuous batch (llama.cpp's own batching); `--jinja` renders the
    model's chat template so `tools` reach the prompt. The start timeout is generous on purpose:
    a busy machine loads slowly, and a wait we did not choose is a bug on a slow day.
    """
    binary = build()
    port = free_port()
    cmd = [
        str(binary),
        "-m",
        str(shipped_gguf()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(parallel),
        "-c",
        str(ctx_per_slot * parallel),
        "--jinja",
        "--no-webui",
        "--alias",
        BASE_MODEL_NAME,
    ]
    if lora is not None:
        cmd += ["--lora", str(lora)]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not ready after {start_timeout:.0f} s")
            time.sleep(0.5)
        yield f"{url}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log:
            out.close()


@dataclass
class Options:
    command: str = option(
        help="build: compile llama-server; serve: run it", positional=True, choices=["build", "serve"]
    )
    parallel: int = option(8, "serve: slots sharing one batch")
    lora: Path | None = option(None, "serve: a LoRA adapter (GGUF) to load")


def run(args: Options) -> None:
    if args.command == "build":
        print(build())
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops llama-server too
    with llama_server(parallel=args.parallel, lora=args.lora) as url:
        print(f"llama-server at {url}; Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
