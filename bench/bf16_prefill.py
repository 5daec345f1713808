"""Prefill in bf16 instead of fp32: how much faster, and how often the greedy choice changes.

Prefill is three quarters of a generation's wall (profile_generation), and the server runs
it in fp32. On a CPU with AVX512-BF16 or AMX (`lscpu` flags `avx512_bf16`, `amx_bf16`),
torch's bf16 matmuls can run faster; without them bf16 is emulated and slower. bf16 also
changes the numbers, so the question is what it costs in decisions.

Both models are the shipped SmolLM2-135M (the server's converted copy) in one process,
2 threads. Speed: a prefill of `--rows` prompts × `--tokens` new tokens without a cache (an
agent step's group, upper end), fp32 and bf16 alternating for `--rounds`, medians. Agreement:
teacher-forced next-token argmax at every position of real text (this repository's
README), fp32 against bf16: the share of positions where greedy decoding would pick the
same token. It does not measure task success; adopting bf16 would need that, paired, on
held-out tasks.

    .venv/bin/python bench/bf16_prefill.py [--rows 8] [--tokens 128] [--rounds 5]

Writes bench/results/bf16_prefill.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _setup import ROOT, bench_settings, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="bf16_prefill")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ratchet.server.precision import cpu_flags
    from ratchet.server.weights import ensure_hf_copy

    torch.set_num_threads(args.threads)
    path = ensure_hf_copy(bench_settings("ratchet-bf16-").models_dir)
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).eval()
        for dtype in ("float32", "bfloat16")
    }
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer((ROOT / "README.md").read_text(), return_tensors="pt").input_ids[:, :2048]
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, tokenizer.vocab_size, (args.rows, args.tokens), generator=generator)

    seconds: dict[str, list[float]] = {d: [] for d in models}
    with torch.inference_mode():
        for m in models.values():  # warm-up
            m(batch, use_cache=False, logits_to_keep=1)
        for _ in range(args.rounds):
            for dtype, m in models.items():
                t = time.perf_counter()
                m(batch, use_cache=False, logits_to_keep=1)
                seconds[dtype].append(time.perf_counter() - t)
        picks = {d: m(text, use_cache=False).logits[0].float().argmax(-1) for d, m in models.items()}
    median = {d: statistics.median(s) for d, s in seconds.items()}
    tokens = args.rows * args.tokens
    summary = {
        "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()],
        "threads": args.threads,
        "prefill_tokens": tokens,
        "prefill_tok_per_s": {d: round(tokens / s, 1) for d, s in median.items()},
        "bf16_speedup": round(median["float32"] / median["bfloat16"], 2),
        "greedy_agreement": round(float((picks["float32"] == picks["bfloat16"]).float().mean()), 4),
        "agreement_positions": int(text.shape[1]),
    }
    write_result(args.name, summary, {"args": vars(args), "seconds": seconds})


if __name__ == "__main__":
    main()
