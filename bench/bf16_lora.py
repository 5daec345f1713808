"""Ways to train the LoRA adapter side by side: as fast as they look, and as good?

Where `model.dtype` means bf16 (`auto` on a CPU with bf16 units) the fine-tune stage trains
under bf16 autocast, each batch as a prefix tree (training/prefix_tree.py). lora_step
times one optimizer step; this measures what a generation pays and gets: the whole training
on one real dataset in each way (`--dtypes`: `float32`; `autocast`, an fp32 base with bf16
products; `bfloat16`, the whole base in bf16; each of them `/tree` to run each batch's
shared prompt tokens once, `finetune.lora.shared_prefixes`), wall time, steps, loss and the
tokens run through the model, then the adapters side by side on held-out tasks. A way may
end in `@N` to train with LoRA seed N (batch order, dropout masks, initialization): the
spread between seeds is what a difference between ways must beat.

The dataset is the one the three-generation bf16 headline trained on in its last generation
(bench/data/coin_headline_dataset.jsonl.gz: 156 examples from 42 coin successes, the format the
fine-tune stage exports), so both formats learn exactly the same examples in the same order.
Evaluation: one embedded server (`--serve-dtype`, default this machine's `auto`), the real
`evaluate` stage, greedy, on the first `--test` coin test tasks; one arm per adapter, then the
base model, same tasks and seeds (bench/harness.py: evaluate_arms), compared task by task with the first arm
(the fp32 adapter).

    .venv/bin/python -m bench bf16_lora [--test 30] [--dtypes float32 autocast bfloat16]
    .venv/bin/python -m bench bf16_lora --dtypes autocast autocast/tree autocast@1 --no-base --test 100
    .venv/bin/python -m bench bf16_lora --work DIR --test 100 --no-base   # the same adapters, more tasks
    .venv/bin/python -m bench bf16_lora --work DIR --dtypes float32 --no-base --rules-from RUN_DATA_DIR

`--rules-from` a run's data dir adds the rules that run promoted, alone and under each
adapter: does the adapter help the policy the loop kept, where its gate plays it?

Writes bench/results/bf16_lora.json and prints the table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.harness import BENCH, MODELS, Arm, arms_table, embedded_server, evaluate_arms, option, write_result

DATASET = BENCH / "data" / "coin_headline_dataset.jsonl.gz"
FAMILY = "textworld-express:coin"
DTYPES = ("float32", "autocast", "bfloat16")  # the first is the arm the others are compared with
WAYS = (*DTYPES, *(f"{d}/tree" for d in DTYPES))


def adapter_dir(work: Path, way: str) -> Path:
    return work / f"adapter-{way.replace('/', '-').replace('@', '-seed')}"


def training_way(spec: str) -> str:
    """`--dtypes` items: a way, optionally with `@seed`."""
    way, _, seed = spec.partition("@")
    if way not in WAYS or (seed and not seed.isdigit()):
        raise argparse.ArgumentTypeError(f"{spec!r}: one of {', '.join(WAYS)}, optionally @SEED")
    return spec


def train(dataset: Path, way: str, out: Path) -> dict[str, object]:
    """Train one adapter on the whole dataset with the default LoRA settings (or take the one a
    previous run of this bench left in `out`, with its record)."""
    record = out.with_name(f"{out.name}.json")
    if record.is_file() and (out / "adapter_model.safetensors").is_file():
        return json.loads(record.read_text())
    from ratchet.config import load_settings
    from ratchet.training.dataset import Dataset
    from ratchet.training.lora import fit_adapter

    data = Dataset.read_openai_jsonl(gzip.decompress(dataset.read_bytes()).decode(), dataset.name)
    cfg = load_settings({}).finetune.lora
    spec, _, seed = way.partition("@")
    dtype, _, tree = spec.partition("/")
    cfg = cfg.model_copy(update={"shared_prefixes": bool(tree), "seed": int(seed or cfg.seed)})
    base = "float32" if dtype == "autocast" else dtype
    result, too_long = fit_adapter(
        MODELS,
        data.examples,
        out,
        cfg,
        dtype=base,
        autocast=dtype == "autocast",
    )
    last_epoch = result.losses[-(result.steps // cfg.epochs) :]
    row = {
        "dtype": way,
        "dataset_version": data.version,
        "examples": result.examples,
        "too_long": too_long,
        "steps": result.steps,
        "tokens": result.tokens,
        "model_tokens": result.model_tokens,
        "wall_s": round(result.wall_seconds, 1),
        "sec_per_step": round(result.wall_seconds / result.steps, 2),
        "first_loss": round(result.losses[0], 4),
        "final_loss": round(result.losses[-1], 4),
        "mean_last_epoch_loss": round(sum(last_epoch) / len(last_epoch), 4),
    }
    print(json.dumps(row), flush=True)
    record.write_text(json.dumps(row))
    return row


def kept_rules(data_dir: Path) -> tuple[object, ...]:
    """The rules a run's library holds as promoted (what its champion plays)."""
    from ratchet.skills.format import load

    found = [load(d) for d in sorted((data_dir / "skills").iterdir()) if (d / "SKILL.md").is_file()]
    rules = tuple(s.rule_spec() for s in found if s.kind == "rule" and s.status == "promoted")
    if not rules:
        raise SystemExit(f"{data_dir / 'skills'} holds no promoted rule")
    print("kept rules:", ", ".join(r.name for r in rules), flush=True)
    return rules


@dataclass
class Options:
    dataset: Path = option(DATASET, "an exported dataset (.jsonl.gz)")
    dtypes: list[str] = option(list(DTYPES), "ways to train", type=training_way)
    serve_dtype: str = option("auto", "the evaluation server's format")
    test: int = option(30, "held-out coin test tasks")
    concurrency: int = option(8)
    name: str = option("bf16_lora", "results file name under bench/results")
    work: Path | None = option(None, "a previous run's work dir: reuse its adapters (more --test)")
    base: bool = option(True, "play the base too")
    rules_from: Path | None = option(None, "a run's data dir: also play the rules it promoted")


def run(args: Options) -> None:
    from ratchet.server.launcher import served_dtype
    from ratchet.server.precision import native_bf16
    from ratchet.server.weights import ensure_hf_copy

    ensure_hf_copy(MODELS)
    work = args.work or Path(tempfile.mkdtemp(prefix="ratchet-bf16-lora-"))
    print(f"work dir: {work}", flush=True)
    trained = [train(args.dataset, way, adapter_dir(work, way)) for way in args.dtypes]
    with embedded_server(work / "server", dtype=args.serve_dtype) as url:
        arms = {f"lora {t['dtype']}": Arm(url, adapter=adapter_dir(work, str(t["dtype"]))) for t in trained}
        if args.base:
            arms["base"] = Arm(url)
        if args.rules_from:
            rules = kept_rules(args.rules_from)
            arms["kept rules"] = Arm(url, rules=rules)
            for t in trained:
                arms[f"kept rules + lora {t['dtype']}"] = Arm(
                    url, adapter=adapter_dir(work, str(t["dtype"])), rules=rules
                )
        shutil.rmtree(work / "eval", ignore_errors=True)  # a fresh evaluation, never a resumed one
        family = evaluate_arms(FAMILY, arms, work / "eval", args.test, args.concurrency, policies=("base",))
        served = served_dtype(url)
    first = next(iter(arms))
    print("| trained | steps | tokens run | wall | s/step | final loss | mean loss, last epoch |")
    print("|---|---|---|---|---|---|---|")
    for t in trained:
        tokens_run = t.get("model_tokens", t["tokens"])
        cells = [
            t["dtype"],
            t["steps"],
            tokens_run,
            f"{t['wall_s']:.0f} s",
            t["sec_per_step"],
            t["final_loss"],
        ]
        print("| " + " | ".join(map(str, [*cells, t["mean_last_epoch_loss"]])) + " |")
    print(arms_table([family], first))
    doc = {"native_bf16": native_bf16(), "served_dtype": served, "training": trained, "evaluation": family}
    write_result(args.name, doc, args)
