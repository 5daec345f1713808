"""What bf16 costs on a CPU without bf16 units, measured on one that has them.

    .venv/bin/python -m bench bf16_emulated [--rounds 3] [--name bf16_emulated]

CI runs on machines of both kinds. Where the CPU has no AVX512-BF16 or AMX-BF16, torch
emulates bf16 products, and the LoRA test that trains under bf16 autocast ran past its 900 s
limit there. This reproduces that path side by side with the native one: each measurement runs
in a fresh process, once as the CPU is (`native`) and once with oneDNN held to AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2`, the instruction set of those machines, where oneDNN has no bf16
kernel). It times, in fp32 and in bf16, a linear of the shapes the model has (256 tokens x 576
-> 1,536, an MLP up-projection) forward and backward, and reports ms per pass and the ratio
bf16 / fp32 under each ISA. No model, no server; under a minute.

Writes bench/results/<name>.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from bench.harness import child_json, option, write_result

ISAS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
CHILD = """
import json, sys, time, torch
torch.manual_seed(0)
rounds = int(sys.argv[1])
out = {}
for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    x = torch.randn(256, 576, dtype=dtype, requires_grad=True)
    w = torch.randn(1536, 576, dtype=dtype, requires_grad=True)
    torch.nn.functional.linear(x, w).sum().backward()  # warm-up: oneDNN builds its kernels
    start = time.perf_counter()
    for _ in range(rounds):
        torch.nn.functional.linear(x, w).sum().backward()
    out[name] = 1000 * (time.perf_counter() - start) / rounds
print(json.dumps(out))
"""


def measure(isa: str, rounds: int) -> dict[str, float]:
    return child_json(CHILD, str(rounds), env=ISAS[isa])


@dataclass
class Options:
    rounds: int = option(3, "timed passes per format and ISA")
    name: str = option("bf16_emulated", "results file name under bench/results")


def run(args: Options) -> None:
    from ratchet.server.precision import native_bf16

    rows = {isa: measure(isa, args.rounds) for isa in ISAS}
    for row in rows.values():
        row["bf16_over_fp32"] = round(row["bfloat16"] / row["float32"], 2)
        row.update({k: round(v, 1) for k, v in row.items() if k != "bf16_over_fp32"})
    summary = {
        "cpu_has_bf16_units": native_bf16(),
        "ms_per_forward_backward": rows,
        "emulated_over_native_bf16": round(rows["avx2"]["bfloat16"] / rows["native"]["bfloat16"], 1),
    }
    print(json.dumps(summary, indent=2))
    write_result(args.name, summary, args)
