"""Ways to compute the server's bf16 prefill attention, timed side by side on this CPU.

    .venv/bin/python -m bench attention_paths [--rounds 4] [--name attention_paths]

On a CPU with AVX512-BF16 but no AMX (the AMD EPYC CI machines), the engine's attention
(`server/attention.py`: torch's CPU flash kernel through `scaled_dot_product_attention`)
runs at fp32 speed: the kernel's products go to MKL's bf16 GEMM, which on a non-Intel CPU
widens to fp32, while the linears reach oneDNN's bf16 kernels. This times, on one thread and
at a verify step's shape (8 rows, 3 key/value heads with 3 folded query heads each, 180 new
tokens over 1,500 columns, the first 100 masked as padding), each path that could avoid it:

* `flash`: the engine's path (the flash kernel);
* `math`: the same call held to torch's math backend (`SDPBackend.MATH`);
* `manual`: QK^T and PV as bf16 `matmul`s (oneDNN), scores softmaxed in fp32;
* `widened`: q, k and v widened to fp32, the flash kernel in fp32 (MKL's fp32 GEMM), the
  result narrowed back to bf16: attention at fp32 with the linears left in bf16;
* `flash` again in fresh processes under MKL's dispatch variables (`MKL_CBWR`,
  `MKL_ENABLE_INSTRUCTIONS`), which would move MKL to another kernel if it listened.

Each path's largest and mean absolute difference from the same attention in fp32 is
reported beside its time: a path that changes the result changes greedy replies, and would
need a held-out check before the engine used it. No model, no server; about a minute.

Writes bench/results/<name>.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import child_json, option, write_result

MKL_ENVS = {
    "MKL_CBWR=AVX512": {"MKL_CBWR": "AVX512"},
    "MKL_CBWR=AVX2": {"MKL_CBWR": "AVX2"},
    "MKL_ENABLE_INSTRUCTIONS=AVX512_E4": {"MKL_ENABLE_INSTRUCTIONS": "AVX512_E4"},
}
CHILD = """
import json, sys, time, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
torch.manual_seed(0)
torch.set_num_threads(1)
rounds, paths = int(sys.argv[1]), sys.argv[2].split(",")
rows, kv_heads, folded, dim, cols = 8, 3, 3 * 180, 64, 1500
q = torch.randn(rows, kv_heads, folded, dim).bfloat16()
k = torch.randn(rows, kv_heads, cols, dim).bfloat16()
v = torch.randn(rows, kv_heads, cols, dim).bfloat16()
mask = torch.ones(rows, 1, folded, cols, dtype=torch.bool)
mask[..., :100] = False
sdpa = torch.nn.functional.scaled_dot_product_attention
ref = sdpa(q.float(), k.float(), v.float(), attn_mask=mask)

def flash():
    return sdpa(q, k, v, attn_mask=mask)

def math():
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v, attn_mask=mask)

def manual():
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(dim**-0.5)
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).bfloat16(), v)

def widened():
    return sdpa(q.float(), k.float(), v.float(), attn_mask=mask).bfloat16()

flops = 4 * rows * kv_heads * folded * cols * dim
out = {}
for name in paths:
    f = globals()[name]
    result = f()  # warm-up
    start = time.perf_counter()
    for _ in range(rounds):
        f()
    seconds = (time.perf_counter() - start) / rounds
    err = (result.float() - ref).abs()
    out[name] = {"ms": 1000 * seconds, "gflops": flops / seconds / 1e9,
                 "max_abs_err": err.max().item(), "mean_abs_err": err.mean().item()}
print(json.dumps(out))
"""


def measure(paths: list[str], rounds: int, env: dict[str, str]) -> dict[str, dict[str, float]]:
    return child_json(CHILD, str(rounds), ",".join(paths), env=env)


@dataclass
class Options:
    rounds: int = option(4, "timed calls per path")
    name: str = option("attention_paths", "results file name under bench/results")


def run(args: Options) -> None:
    from ratchet.server.precision import native_bf16

    rows = measure(["flash", "math", "manual", "widened"], args.rounds, {})
    for label, env in MKL_ENVS.items():
        rows[f"flash, {label}"] = measure(["flash"], args.rounds, env)["flash"]
    for label, row in rows.items():
        print(
            f"{label:42s} {row['ms']:7.1f} ms {row['gflops']:6.1f} GFLOP/s  "
            f"|err| max {row['max_abs_err']:.4f} mean {row['mean_abs_err']:.5f}"
        )
    write_result(args.name, {"cpu_has_bf16_units": native_bf16(), "paths": rows}, args)
