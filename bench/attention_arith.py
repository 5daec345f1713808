"""How fast each kind of bf16 product runs on this CPU: the server's linears against its attention.

    .venv/bin/python bench/attention_arith.py [--threads 1] [--rounds 5] [--name attention_arith]

A perf profile of the bf16 server during verify (bench/RESULTS.md, attention_arith) put about
30% of its CPU in MKL's generic fp32 GEMM kernel (`mkl_blas_def_sgemm_kernel_0_zen`) and 27% in
oneDNN's JIT kernels. The linears are bf16 products through oneDNN; SDPA's CPU flash attention,
without AMX, does its two products through `cpublas::gemm`, which reaches MKL's bf16 GEMM, and
MKL on a non-Intel CPU takes its generic path: bf16 widened to fp32, then a plain fp32 kernel.
This times, side by side in one process, the same arithmetic in the shapes one verify prefill
has (8 rows, 180 new tokens over 1,500 cached, 9 query heads folded onto 3 key/value heads,
head dim 64; server/attention.py), and reports GFLOP/s:

* `linear`: an MLP up-projection, 1,440 tokens x 576 -> 1,536 (what the JIT kernels do);
* `sdpa_bf16`: the folded attention as the server runs it, masked, flash kernel, bf16;
* `sdpa_fp32`: the same in fp32;
* `scores_linear`: only QK^T, as one `F.linear` per (row, key/value head) block, bf16 out;
* `scores_bmm`: only QK^T, as one batched `bmm`, bf16 out.

Attention FLOPs count both products (4 * rows * heads * queries * keys * dim). No model, no
server; a few seconds. Writes bench/results/<name>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS, KV_HEADS, GROUPS, NEW, PAST, DIM = 8, 3, 3, 180, 1500, 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--name", default="attention_arith")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    from ratchet.server.precision import cpu_flags

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    bf = torch.bfloat16
    keys = PAST + NEW
    q = torch.randn(ROWS, KV_HEADS, GROUPS * NEW, DIM).to(bf)
    k = torch.randn(ROWS, KV_HEADS, keys, DIM).to(bf)
    v = torch.randn(ROWS, KV_HEADS, keys, DIM).to(bf)
    mask = torch.ones(ROWS, 1, GROUPS * NEW, keys, dtype=torch.bool)
    mask[0, :, :, :100] = False  # a padded row, as in every engine prefill
    x = torch.randn(ROWS * NEW, 576).to(bf)
    w = torch.randn(1536, 576).to(bf)
    qf, kf, vf = q.float(), k.float(), v.float()
    blocks = [(q[r, h], k[r, h]) for r in range(ROWS) for h in range(KV_HEADS)]
    kt = k.transpose(-1, -2)
    att = 4 * ROWS * KV_HEADS * GROUPS * NEW * keys * DIM
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "linear": (lambda: F.linear(x, w), 2 * ROWS * NEW * 576 * 1536),
        "sdpa_bf16": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), att),
        "sdpa_fp32": (lambda: F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask), att),
        "scores_linear": (lambda: [F.linear(a, b) for a, b in blocks], att // 2),
        "scores_bmm": (lambda: torch.matmul(q, kt), att // 2),
    }
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    with torch.no_grad():
        for fn, _ in cases.values():
            fn()  # warm up (oneDNN builds its kernels on first use)
        for _ in range(args.rounds):  # interleaved: a noisy neighbour hits every case alike
            for name, (fn, _) in cases.items():
                t0 = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - t0)
    rows = {}
    for name, (_, flops) in cases.items():
        median = sorted(seconds[name])[len(seconds[name]) // 2]
        rows[name] = {"median_ms": round(median * 1e3, 2), "gflops": round(flops / median / 1e9, 1)}
    flags = cpu_flags()
    out = {
        "args": vars(args),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "shape": {"rows": ROWS, "new": NEW, "past": PAST, "heads": KV_HEADS * GROUPS, "kv_heads": KV_HEADS},
        "results": rows,
    }
    print(f"torch {torch.__version__}, {args.threads} thread(s), avx512_bf16={out['avx512_bf16']}")
    print("| product | median ms | GFLOP/s |")
    print("|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['median_ms']} | {r['gflops']} |")
    path = ROOT / "bench" / "results" / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
