"""Prefill and decode tokens/s of the embedded server at 1, 4 and 8 concurrent requests.

Next to raw batched `generate` in this process and, with `--anchor`, llama.cpp's own server
on the same GGUF, interleaved in one run (the machine is shared and noisy: compare ratios,
not absolute numbers).

    .venv/bin/python -m bench serve_throughput [--tokens 96] [--prompt-words 400] [--rounds 3] [--anchor]

* decode: every request generates exactly --tokens tokens (`ignore_eos`), greedy, from short
  distinct prompts; aggregate completion tokens per second of wall.
* prefill: every request is a new prompt of about --prompt-words words (an agent step's size;
  its first words are unique so no prefix cache can help) and asks for one token; aggregate
  prompt tokens per second of wall, as each server counts them (same GGUF tokenizer).

`--anchor` builds llama-server once from the llama.cpp that the llama-cpp-python sdist vendors
(`python -m bench llama_cpp build`, 10-20 min the first time) and runs it with 2 threads and 8 slots.
Goals: ratchet at 8 concurrent >= 3x one request and >= 0.8x raw batched generate (decode);
ratchet >= 1.0x llama.cpp at 8 concurrent, prefill and decode.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import httpx

from bench.harness import MODELS, RESULTS, embedded_server, option, write_result
from ratchet.server.weights import BASE_MODEL_NAME

PROMPTS = [f"Write a long story about robot number {i} who learns to cook." for i in range(8)]
# words of the kind an agent's prompt is made of (rooms, objects, moves), drawn at random
_WORDS = (
    "you are in the kitchen pantry corridor backyard a an the to north south east west door is open "
    "closed there you see coin fridge table counter move take look inventory valid actions your task "
    "find and it on of what do next step observation history room nothing happens"
).split()
_fresh = count()


def _long_prompt(words: int) -> str:
    n = next(_fresh)
    rng = random.Random(n)
    return f"Request {n:06d} {rng.random():.6f}. " + " ".join(rng.choice(_WORDS) for _ in range(words))


def _post(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/chat/completions", timeout=1800, json={"model": BASE_MODEL_NAME, **body})
    r.raise_for_status()
    return r.json()["usage"]


def decode_tps(url: str, concurrency: int, tokens: int) -> float:
    def one(i: int) -> int:
        usage = _post(
            url,
            {
                "messages": [{"role": "user", "content": PROMPTS[i]}],
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        if usage["completion_tokens"] != tokens:  # a server that stopped early would flatter itself
            raise RuntimeError(f"{url} generated {usage['completion_tokens']} tokens, asked {tokens}")
        return int(usage["completion_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(one, range(concurrency)))
    return total / (time.perf_counter() - started)


def prefill_tps(url: str, concurrency: int, words: int) -> float:
    prompts = [_long_prompt(words) for _ in range(concurrency)]

    def one(text: str) -> int:
        usage = _post(
            url, {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
        )
        return int(usage["prompt_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(one, prompts))
    return total / (time.perf_counter() - started)


def raw_tps(model: object, tok: object, batch: int, tokens: int) -> float:
    import torch

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


METRICS = ("decode_c1", "decode_c4", "decode_c8", "prefill_c1", "prefill_c8")


def _ratio(med: dict[str, float], a: str, b: str) -> float | None:
    return round(med[a] / med[b], 2) if a in med and b in med else None


@dataclass
class Options:
    tokens: int = option(96, "decode: tokens generated per request")
    prompt_words: int = option(400, "prefill: words per fresh prompt")
    rounds: int = option(3)
    anchor: bool = option(False, "also measure llama.cpp's server (built on first use)")
    raw: bool = option(True, "raw batched generate in this process (--no-raw: skip it)")
    dtypes: list[str] = option(
        ["auto"],
        "one embedded server per number format (`model.dtype`), side by side",
        choices=["float32", "auto", "bfloat16"],
    )
    models_dir: Path = option(MODELS)
    out: Path = option(RESULTS / "serve_throughput.json")


def run(args: Options) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ratchet.server.launcher import served_dtype
    from ratchet.server.weights import ensure_hf_copy

    torch.set_num_threads(2)  # the servers use 2 threads too
    model_dir = ensure_hf_copy(args.models_dir)
    model = tok = None
    if args.raw:
        tok = AutoTokenizer.from_pretrained(model_dir)
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    results: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        servers = {
            ("ratchet" if len(args.dtypes) == 1 else f"ratchet_{dtype}"): stack.enter_context(
                embedded_server(logs / dtype, dtype=dtype, models=args.models_dir)
            )
            for dtype in args.dtypes
        }
        if args.anchor:
            from bench.llama_cpp import llama_server

            servers["llamacpp"] = stack.enter_context(llama_server(log=logs / "llama-server.log"))
        dtypes = {name: served_dtype(url) for name, url in servers.items() if name.startswith("ratchet")}
        for url in servers.values():  # warm up every path
            decode_tps(url, 2, 8)
            prefill_tps(url, 2, 50)
        if model is not None:
            raw_tps(model, tok, 2, 8)
        for r in range(args.rounds):
            for name, url in servers.items():
                for c in (1, 4, 8):
                    record(f"{name}_decode_c{c}", decode_tps(url, c, args.tokens))
                for c in (1, 8):
                    record(f"{name}_prefill_c{c}", prefill_tps(url, c, args.prompt_words))
            if model is not None:
                for b in (1, 8):
                    record(f"raw_decode_b{b}", raw_tps(model, tok, b, args.tokens))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items()), flush=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    summary = {
        "tokens_per_request": args.tokens,
        "prompt_words": args.prompt_words,
        "rounds": args.rounds,
        "median_tokens_per_s": {k: round(v, 1) for k, v in med.items()},
        "ratchet_decode_c8_over_c1": _ratio(med, "ratchet_decode_c8", "ratchet_decode_c1"),
        "ratchet_decode_c4_over_c1": _ratio(med, "ratchet_decode_c4", "ratchet_decode_c1"),
        "ratchet_decode_c8_over_raw_b8": _ratio(med, "ratchet_decode_c8", "raw_decode_b8"),
        "ratchet_decode_c1_over_raw_b1": _ratio(med, "ratchet_decode_c1", "raw_decode_b1"),
        "dtypes": dtypes,
        **{
            f"{name}_over_llamacpp": {
                m: _ratio(med, f"{name}_{m}", f"llamacpp_{m}") for m in METRICS if f"llamacpp_{m}" in med
            }
            for name in servers
            if name.startswith("ratchet") and "llamacpp" in servers
        },
    }
    if len(args.dtypes) > 1:
        first, *others = (n for n in servers if n.startswith("ratchet"))
        summary["over_" + first] = {
            n: {m: _ratio(med, f"{n}_{m}", f"{first}_{m}") for m in METRICS} for n in others
        }
    print(json.dumps(summary, indent=2))
    write_result("serve_throughput", summary, args, path=args.out)
