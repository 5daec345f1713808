"""The embedded model's number format: bf16 where the CPU multiplies it natively, else fp32.

Prefill is most of a generation's wall time, and it is matrix products. CPUs with
AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake) or AMX-BF16 (Intel Sapphire Rapids and
later) run bf16 products with fp32 accumulation at two to three times fp32's rate; without
them torch emulates bf16 and it is slower than fp32. So `auto` picks bf16 only where those
units exist (speed: bench/results/bf16_prefill.json; bench/results/bf16_heldout.json checks, paired on
held-out tasks, that success does not drop).

Why `auto` is the default: bf16 evaluates about 1.6× faster with held-out success within
noise (20 vs 21 of 120 paired, +1 / −2), and the README's first `ratchet evolve` promotes its
rule in bf16 as in fp32 (5 and 7 repairs, no regression, in 24 dev tasks; held-out 0 → 5
and 0 → 7 of 10), in 10.3 min against 22.0, back to back on one machine (their explores filed
6 and 7 candidates; prefill 1.5× faster per token; bench/RESULTS.md, profile_generation). It
was fp32 while that run gated on 16 dev tasks, where bf16 fell short of the 5 repairs the gate
needs. `model.dtype = "float32"` gives identical greedy runs on every machine of one
instruction set; `auto` gives each machine its fastest exact-enough format.

What changes with the format: greedy choices, at a few percent of positions (bf16 rounds
each layer's output to 8 mantissa bits). Both arms of a gate run on one server, so the gate
compares like with like; a run's policy versions all play at one precision, recorded in the
server's `/health` and the generation's MLflow params (`model_dtype`). It is not part of a
policy's version: the version says what the policy is made of (model, adapter, skills), and
the format is how this machine serves it, like its thread count or its CPU's fp32 rounding.
Logits are read in fp32 for sampling either way. LoRA training follows the same setting:
bf16 matrix products under autocast where `auto` means bf16 (`training/lora.py`: 1.39× faster,
held-out within noise), everything the adapter is made of in fp32; peft keeps that fp32
adapter in fp32 on the bf16 base it is served on.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Precision = Literal["auto", "float32", "bfloat16"]

# /proc/cpuinfo flags of native bf16 matrix arithmetic
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def native_bf16(flags: set[str] | None = None) -> bool:
    """True where bf16 products run in hardware (faster than fp32), not emulated (slower)."""
    have = cpu_flags() if flags is None else flags
    return any(f in have for f in BF16_FLAGS)


def dtype_name(precision: Precision, flags: set[str] | None = None) -> str:
    """The format a configured precision means on this CPU: "bfloat16" or "float32" (the
    name `/health` reports; torch is not imported for it)."""
    if precision == "auto":
        return "bfloat16" if native_bf16(flags) else "float32"
    if precision in ("bfloat16", "float32"):
        return precision
    raise ValueError(f"unknown precision {precision!r}: use auto, float32 or bfloat16")


def resolve(precision: Precision, flags: set[str] | None = None) -> torch.dtype:
    """The dtype the engine loads the model in for a configured precision."""
    import torch

    return getattr(torch, dtype_name(precision, flags))
