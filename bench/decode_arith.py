"""Cheaper decode arithmetic, measured: the engine's decode throughput with the layers' own
4-bit weights (the GGUF's Q4_1 blocks through torch's int4 CPU kernel) and a bf16 output head,
next to today's fp32, under OpenMP wait policies; and how often greedy output stays the same.

    .venv/bin/python bench/decode_arith.py [--tokens 96] [--rounds 2]

Each configuration runs in its own process (the wait policy is read at process start): the
real `Engine` in process, 8 concurrent and 1 request of --tokens tokens (`ignore_eos`),
greedy, the same 8 prompts. Configurations:

* weights `fp32` (today), `int4` (every q/k/v/o/gate/up/down Linear: decode steps through
  `_weight_int4pack_mm_for_cpu`, bf16 activations; prefill stays fp32), `int4+bf16head`
  (the 49152 x 576 output head in bf16 as well);
* wait `PASSIVE` (the server's default), `spin10k` (policy unset, `GOMP_SPINCOUNT=10000`).

Why int4 is exact on weights: SmolLM2's GGUF stores every layer Linear as Q4_1 (blocks of 32,
w = d*q + m, q in 0..15), so each group re-quantizes with zero error and
scale = d, zero = m + 8d is torch's (q - 8) * scale + zero. The activations are what change:
the kernel takes bf16 inputs (fp32 inputs fall to a slow reference path).

Writes bench/results/decode_arith.json: tokens/s per configuration (median of --rounds) and,
per configuration, how many of the 8 greedy outputs equal fp32's token for token and the
mean first position where they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP = 32
PROMPTS = [f"Write a long story about robot number {i} who learns to cook." for i in range(8)]
WAITS = {"PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin10k": {"GOMP_SPINCOUNT": "10000"}}
WEIGHTS = ("fp32", "int4", "int4+bf16head")


def quantize_decode(model: object, head: bool) -> int:
    """Give every layer Linear an int4 decode path (and the head a bf16 one); returns how many
    weights changed by re-quantizing (0 for a Q4_1 GGUF)."""
    import torch

    changed = 0
    for name, lin in model.named_modules():  # type: ignore[attr-defined]
        if not isinstance(lin, torch.nn.Linear):
            continue
        w = lin.weight.data
        if name.endswith("lm_head"):
            if head:
                lin._bf16 = w.bfloat16()
                lin.forward = _bf16_forward(lin)
            continue
        n, k = w.shape
        groups = w.view(n, k // GROUP, GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        d = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
        q = ((groups - low) / d).round().clamp(0, 15)
        changed += int(((q * d + low).view(n, k) != w).sum())
        lin._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(n, k), 1)
        lin._scales = (
            torch.stack([d.squeeze(-1).t(), (low + 8 * d).squeeze(-1).t()], -1).contiguous().bfloat16()
        )
        lin.forward = _int4_forward(lin, lin.forward)
    return changed


def _int4_forward(lin: object, fp32: object) -> object:
    import torch

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] != 1:  # prefill: today's fp32
            return fp32(x)  # type: ignore[operator]
        flat = x.reshape(-1, x.shape[-1]).bfloat16()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, lin._packed, GROUP, lin._scales)  # type: ignore[attr-defined]
        return y.float().view(*x.shape[:-1], -1)

    return forward


def _bf16_forward(lin: object) -> object:
    import torch

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.bfloat16(), lin._bf16).float()  # type: ignore[attr-defined]

    return forward


def child(weights: str, tokens: int, rounds: int) -> None:
    """One configuration, in this process: prints one JSON line."""
    import torch

    from ratchet.server.engine import Engine, GenRequest
    from ratchet.server.weights import ensure_hf_copy

    torch.set_num_threads(2)
    engine = Engine(ensure_hf_copy(ROOT / ".ratchet" / "models"))
    changed = quantize_decode(engine.model, head="bf16head" in weights) if weights != "fp32" else 0
    tok = engine.tokenizer

    def run(n: int, max_tokens: int) -> tuple[float, list[list[int]]]:
        reqs = [
            GenRequest(prompt_ids=tok(p)["input_ids"], max_tokens=max_tokens, temperature=0, ignore_eos=True)
            for p in PROMPTS[:n]
        ]
        started = time.perf_counter()
        outs = [f.result() for f in [engine.submit(r) for r in reqs]]
        return n * max_tokens / (time.perf_counter() - started), [o.token_ids for o in outs]

    run(2, 8)  # warm-up
    rates: dict[str, list[float]] = {"c1": [], "c8": []}
    outputs: list[list[int]] = []
    for _ in range(rounds):
        rate, outputs = run(8, tokens)
        rates["c8"].append(rate)
        rates["c1"].append(run(1, tokens)[0])
    engine.close()
    result = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({"rates": result, "outputs": outputs, "weights_changed": changed}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.tokens, args.rounds)
        return
    runs: dict[str, dict] = {}
    for wait, env in WAITS.items():
        for weights in WEIGHTS:
            base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    weights,
                    "--tokens",
                    str(args.tokens),
                    "--rounds",
                    str(args.rounds),
                ],
                env=base | {"OMP_NUM_THREADS": "2"} | env,
                capture_output=True,
                text=True,
                check=True,
            )
            runs[f"{weights} {wait}"] = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{weights:>14} {wait:<8} "
                + ", ".join(f"{k} {v:.1f} tok/s" for k, v in runs[f"{weights} {wait}"]["rates"].items()),
                flush=True,
            )
    reference = runs["fp32 PASSIVE"]["outputs"]
    summary: dict[str, dict] = {}
    for key, run in runs.items():
        firsts = [
            next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
            for o, r in zip(run["outputs"], reference, strict=True)
        ]
        summary[key] = {
            "tokens_per_s": {k: round(v, 1) for k, v in run["rates"].items()},
            "vs_fp32_passive": {
                k: round(v / runs["fp32 PASSIVE"]["rates"][k], 2) for k, v in run["rates"].items()
            },
            "same_greedy_output": sum(f == len(r) for f, r in zip(firsts, reference, strict=True)),
            "mean_first_difference": round(statistics.mean(firsts), 1),
            "weights_changed_by_requantizing": run["weights_changed"],
        }
    doc = {"tokens": args.tokens, "rounds": args.rounds, "requests": len(PROMPTS), "configs": summary}
    print(json.dumps(doc, indent=2))
    out = ROOT / "bench" / "results" / "decode_arith.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
