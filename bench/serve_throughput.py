"""Aggregate decode throughput of the embedded server at 1, 4 and 8 concurrent requests,
next to raw batched `generate` in this process, interleaved in one run (the machine is shared
and noisy: compare ratios, not absolute numbers).

    .venv/bin/python bench/serve_throughput.py [--tokens 96] [--rounds 3]

Every request generates exactly --tokens tokens (`ignore_eos`), greedy, from distinct prompts.
Goals: 8 concurrent >= 3x one request, and >= 0.8x raw batched generate at batch 8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ratchet.server.launcher import EmbeddedServer  # noqa: E402
from ratchet.server.weights import BASE_MODEL_NAME, ensure_hf_copy  # noqa: E402

PROMPTS = [f"Write a long story about robot number {i} who learns to cook." for i in range(8)]


def server_tps(url: str, concurrency: int, tokens: int) -> float:
    def one(i: int) -> int:
        r = httpx.post(
            f"{url}/chat/completions",
            timeout=600,
            json={
                "model": BASE_MODEL_NAME,
                "messages": [{"role": "user", "content": PROMPTS[i]}],
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(one, range(concurrency)))
    return total / (time.perf_counter() - started)


def raw_tps(model: object, tok: object, batch: int, tokens: int) -> float:
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS[:batch]
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    generated = (out.shape[1] - enc["input_ids"].shape[1]) * batch
    return generated / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models-dir", type=Path, default=ROOT / ".ratchet" / "models")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)  # the server uses 2 threads too
    model_dir = ensure_hf_copy(args.models_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    results: dict[str, list[float]] = {
        k: [] for k in ("server_c1", "server_c4", "server_c8", "raw_b1", "raw_b8")
    }
    with tempfile.TemporaryDirectory() as logs, EmbeddedServer(args.models_dir, Path(logs)) as url:
        server_tps(url, 2, 8)  # warm up both paths
        raw_tps(model, tok, 2, 8)
        for r in range(args.rounds):
            for c in (1, 4, 8):
                results[f"server_c{c}"].append(server_tps(url, c, args.tokens))
            for b in (1, 8):
                results[f"raw_b{b}"].append(raw_tps(model, tok, b, args.tokens))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items()), flush=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    summary = {
        "tokens_per_request": args.tokens,
        "rounds": args.rounds,
        "median_tokens_per_s": {k: round(v, 1) for k, v in med.items()},
        "server_c8_over_c1": round(med["server_c8"] / med["server_c1"], 2),
        "server_c4_over_c1": round(med["server_c4"] / med["server_c1"], 2),
        "server_c8_over_raw_b8": round(med["server_c8"] / med["raw_b8"], 2),
        "server_c1_over_raw_b1": round(med["server_c1"] / med["raw_b1"], 2),
    }
    print(json.dumps(summary, indent=2))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_throughput.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
