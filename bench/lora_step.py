"""Seconds per LoRA optimizer step and peak memory: ratchet's trainer vs a plain peft loop.

    .venv/bin/python -m bench lora_step [--steps 6] [--rounds 2] [--batch 8]
        [--methods plain ratchet ratchet_bf16 ratchet_autocast]

Both train the same LoRA config (finetune.lora defaults: r=16 on q,k,v,o) on the same batch
of real training examples (coin expert trajectories replayed into the actor's prompts).

* plain: the textbook peft loop: a right-padded batch with its attention mask,
  `model(input_ids, attention_mask, labels=labels).loss`, every position projected onto the
  49k vocabulary;
* ratchet: `training.lora.accumulate` — the same examples one at a time without padding
  (causal-only attention takes the flash kernel), gradients accumulated, the projection only
  on the labelled positions. This batch (one call from each of 8 tasks) shares little but
  the system prompt, so the prefix tree (`finetune.lora.shared_prefixes`) is measured on
  real batches by bf16_lora;
* ratchet_bf16: the same loop with the whole frozen base in bf16 (the adapter stays fp32);
  as fast, but it loses held-out tasks (bf16_lora), so the stage does not use it;
* ratchet_autocast: the same loop with an fp32 base, its matrix products in bf16 under
  torch.autocast (norms, residual stream and weights stay fp32): what the fine-tune stage
  does where the CPU has bf16 units (`model.dtype = "auto"`).

The batch is the `--batch` examples nearest the median length (not the longest: with a mask,
the plain loop keeps every layer's full attention matrix, and 8 examples of ~1.5k tokens
need more than the machine's 24 GB).

Each measurement runs in a fresh subprocess (so peak RSS is that method's own), methods
alternate over `--rounds` rounds on the same machine, and the first step (warm-up) is not
timed. Reported: median seconds per step, speed ratio, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import MODELS, RESULTS, ROOT, option, write_result

METHODS = ("plain", "ratchet", "ratchet_bf16", "ratchet_autocast")


def _batch(n: int) -> list:  # type: ignore[type-arg]
    from ratchet.agents.rollout import RolloutSlot, run_expert
    from ratchet.suites import get_suite
    from ratchet.training.dataset import build_dataset

    suite = get_suite("textworld-express:coin")
    try:
        found = [run_expert(suite, RolloutSlot("b", 0, t, -1)) for t in suite.tasks("train", 2 * n)]
    finally:
        suite.close()
    return build_dataset([t for t in found if t is not None], per_task=1).examples


def worker(method: str, steps: int, batch_size: int) -> dict[str, float]:
    import torch

    from ratchet.config import load_settings
    from ratchet.server.weights import ensure_hf_copy
    from ratchet.training.lora import accumulate, collate, encode_all, load_for_training

    cfg = load_settings({}).finetune.lora
    dtype = "bfloat16" if method == "ratchet_bf16" else "float32"
    model, tok = load_for_training(ensure_hf_copy(MODELS), cfg, dtype)
    data, _ = encode_all(_batch(batch_size), tok, cfg.max_tokens)
    data = sorted(data, key=lambda e: len(e.input_ids))
    mid = len(data) // 2
    data = data[max(0, mid - batch_size // 2) :][:batch_size]
    ids, labels, mask = collate(data, tok.pad_token_id)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    model.train()
    times = []
    for i in range(steps + 1):
        started = time.perf_counter()
        if method == "plain":
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
        else:
            loss = accumulate(model, data, autocast=method == "ratchet_autocast")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - started)
    return {
        "sec_per_step": statistics.median(times),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tokens_per_batch": int(mask.sum()),
        "target_tokens": int((labels != -100).sum()),
        "loss": float(loss),
        "lengths": [len(e.input_ids) for e in data],
    }


@dataclass
class Options:
    steps: int = option(6, "timed optimizer steps per measurement (after one warm-up step)")
    rounds: int = option(2)
    batch: int = option(8, "examples per batch")
    methods: list[str] = option(list(METHODS), choices=METHODS)
    worker: str | None = option(None, argparse.SUPPRESS, choices=METHODS)  # one measurement, in a child
    out: Path = option(RESULTS / "lora_step.json")


def run(args: Options) -> None:
    from ratchet.server.precision import native_bf16

    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.batch)))
        return
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.methods}
    for r in range(args.rounds):
        for method in args.methods if r % 2 == 0 else args.methods[::-1]:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench",
                    "lora_step",
                    "--worker",
                    method,
                    "--steps",
                    str(args.steps),
                    "--batch",
                    str(args.batch),
                ],
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
            ).stdout
            runs[method].append(json.loads(out.strip().splitlines()[-1]))
            print(method, runs[method][-1], flush=True)
    summary = {
        m: {
            "sec_per_step": statistics.median(x["sec_per_step"] for x in rs),
            # batches may differ a little between processes (sampled rollouts)
            "tok_per_s": statistics.median(x["tokens_per_batch"] / x["sec_per_step"] for x in rs),
            "peak_rss_mb": max(x["peak_rss_mb"] for x in rs),
        }
        for m, rs in runs.items()
    }
    first = runs[args.methods[0]][0]
    print(
        f"\nbatch {args.batch} examples, {first['tokens_per_batch']} tokens, {first['target_tokens']} learned"
    )
    print("| loop | s/step | tokens/s | peak RSS |\n|---|---|---|---|")
    for m, s in summary.items():
        print(f"| {m} | {s['sec_per_step']:.2f} | {s['tok_per_s']:.0f} | {s['peak_rss_mb'] / 1024:.2f} GB |")
    ratios = {
        f"{a}/{b}": summary[a]["tok_per_s"] / summary[b]["tok_per_s"]
        for a, b in (("ratchet", "plain"), ("ratchet_bf16", "ratchet"), ("ratchet_autocast", "ratchet"))
        if a in summary and b in summary
    }
    for name, speed in ratios.items():
        a, b = name.split("/")
        print(f"{a} speed = {speed:.2f}x {b} (tokens per second)")
    out = {"cpu_bf16": native_bf16(), "runs": runs, "summary": summary, "speed_ratios": ratios}
    write_result("lora_step", out, args, path=args.out)
