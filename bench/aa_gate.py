"""A/A on the real engine: how often does the verify gate admit a candidate that cannot help?

Each candidate is an *irrelevant* skill (advice about cooking, gardening, travel...) for an
arithmetic family. It changes the prompt, so with the real model (SmolLM2-135M on the
embedded server) the candidate arm's answers differ from the baseline's on some tasks in
both directions: real noise, not identical arms. It cannot help on purpose, so every
admission is a false promotion. Reported with a 95% Clopper-Pearson interval.

    .venv/bin/python -m bench aa_gate [--gates 40] [--dev 16] [--max-steps 3]

Promotion is `manual` here, so every gate runs against the same champion. One verify run
plays the shared baseline arm once and the candidates' arms in batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import (
    bench_settings,
    clopper_pearson,
    fresh_data_dir,
    install_champion,
    option,
    write_result,
)

TOPICS = [
    ("bread", "let the dough rest before baking"),
    ("tomatoes", "water the roots, not the leaves"),
    ("trains", "check the platform twice"),
    ("bicycles", "keep the chain oiled"),
    ("tea", "warm the pot first"),
    ("roses", "prune in early spring"),
    ("camping", "pitch the tent on high ground"),
    ("painting", "prime the wall first"),
    ("sailing", "watch the wind on the water"),
    ("chess", "control the centre"),
    ("coffee", "grind the beans just before brewing"),
    ("knitting", "count stitches every row"),
    ("hiking", "carry more water than you expect to need"),
    ("soup", "add salt at the end"),
    ("birds", "fill the feeder in winter"),
    ("photography", "keep the sun behind you"),
    ("pottery", "wedge the clay well"),
    ("running", "warm up for ten minutes"),
    ("cheese", "let it breathe before serving"),
    ("fishing", "go out at dawn"),
    ("skiing", "lean forward on steep slopes"),
    ("orchids", "water them once a week"),
    ("guitar", "tune before every session"),
    ("beekeeping", "move slowly near the hive"),
    ("origami", "crease each fold sharply"),
    ("sourdough", "feed the starter daily"),
    ("kayaking", "keep your paddle blade vertical"),
    ("astronomy", "let your eyes adapt to the dark"),
    ("woodwork", "measure twice and cut once"),
    ("swimming", "breathe out under water"),
    ("calligraphy", "hold the pen at a steady angle"),
    ("composting", "turn the heap every week"),
    ("juggling", "throw to eye height"),
    ("climbing", "keep three points of contact"),
    ("wine", "store bottles on their side"),
    ("dogs", "reward calm behaviour"),
    ("bonsai", "repot every two years"),
    ("pasta", "salt the water generously"),
    ("sewing", "press each seam open"),
    ("cycling tours", "pack a spare inner tube"),
]


def irrelevant_skills(n: int, family: str) -> list:
    from ratchet.skills.format import Skill

    out = []
    for i in range(n):
        topic, advice = TOPICS[i % len(TOPICS)]
        out.append(
            Skill(
                name=f"aa-{topic.replace(' ', '-')}-{i}",
                description=f"Advice about {topic}.",
                body=f"When: you deal with {topic}.\n\nWhat to do:\n1. {advice.capitalize()}.",
                kind="procedure",
                family=family,
                evolution="aa",
                generation=0,
                provenance=["bench"],
            )
        )
    return out


def run_aa(
    gates: int = 40,
    dev: int = 16,
    suite: str = "reasoning-gym:chain_sum",
    max_steps: int = 3,
    concurrency: int = 8,
    data_dir: Path | None = None,
    base_url: str | None = None,
    temperature: float = 0.0,
    adapter: Path | None = None,
) -> dict:
    """Gate `gates` irrelevant candidates against the base policy; the summary of what passed."""
    from ratchet.flows.launch import run_flow
    from ratchet.flows.runtime import open_library
    from ratchet.flows.verify import verify_flow

    data = data_dir or fresh_data_dir("ratchet-aa-")
    settings = bench_settings(
        data,
        {
            "evolution": "aa",
            "suite": suite,
            "splits.dev": dev,
            "max_steps": max_steps,
            "concurrency": concurrency,
            "verify.promotion": "manual",
            "evaluate.temperature": temperature,
        },
    )
    if adapter is not None:
        install_champion(settings, adapter)
    library = open_library(settings)
    family = suite.split(",")[0]
    for skill in irrelevant_skills(gates, family):
        if skill.name not in library.names():
            library.add(skill, who="bench")
    started = time.perf_counter()
    result = run_flow(verify_flow, settings, generation=0, base_url=base_url)
    wall = time.perf_counter() - started
    # every gate of this data dir, also those decided by an earlier (resumed) run
    gates_ = [
        r.evidence
        for name in sorted(library.names())
        if name.startswith("aa-")
        for r in library.history(name)[-1:]
        if r.who == "verify" and r.to_status in ("verified", "rejected")
    ]
    accepted = [e for e in gates_ if e["decision"] == "accept"]
    discordant = [e["repairs"] + e["regressions"] for e in gates_]
    lo, hi = clopper_pearson(len(accepted), len(gates_))
    return {
        "suite": suite,
        "temperature": temperature,
        "adapter": str(adapter) if adapter else None,
        "gates": len(gates_),
        "accepted": len(accepted),
        "false_promotion_rate": len(accepted) / max(1, len(gates_)),
        "ci95": [lo, hi],
        "alpha": settings.verify.alpha,
        "gates_with_discordant_pairs": sum(d > 0 for d in discordant),
        "mean_discordant": sum(discordant) / max(1, len(discordant)),
        "repairs": sum(e["repairs"] for e in gates_),
        "regressions": sum(e["regressions"] for e in gates_),
        "candidate_rollouts": sum(e["rollouts"] // 2 for e in gates_),
        "baseline_rollouts_this_run": result.baseline_rollouts,
        "baseline_successes": _baseline_successes(settings),
        "wall_seconds": round(wall, 1),
        "data_dir": str(data),
    }


def _baseline_successes(settings: Any) -> list[int]:
    """[successes, tasks] of the champion's shared baseline arm on the dev split."""
    from ratchet.flows.verify import BASELINE
    from ratchet.memory.trajectory_store import open_store

    store = open_store(settings.trajectories_db)
    try:
        base = [t for t in store.query(split="dev") if t.arm == BASELINE]
    finally:
        store.close()
    return [sum(t.success for t in base), len(base)]


@dataclass
class Options:
    gates: int = option(40)
    dev: int = option(16, "dev tasks (max tasks per gate)")
    suite: str = option("reasoning-gym:chain_sum")
    max_steps: int = option(3)
    concurrency: int = option(8)
    adapter: Path | None = option(None, "a LoRA adapter dir to test as the champion")
    temperature: float = option(0.0, "the policy's sampling temperature (0 = greedy)")
    data_dir: Path | None = option(None, "reuse (resume) a previous run's state")


def run(opts: Options) -> None:
    summary = run_aa(
        opts.gates,
        opts.dev,
        opts.suite,
        opts.max_steps,
        opts.concurrency,
        opts.data_dir,
        temperature=opts.temperature,
        adapter=opts.adapter,
    )
    lo, hi = summary["ci95"]
    solved, dev_tasks = summary["baseline_successes"]
    print(
        f"A/A on {opts.suite}: {summary['accepted']}/{summary['gates']} irrelevant candidates admitted "
        f"(rate {summary['false_promotion_rate']:.1%}, 95% CI {lo:.1%}-{hi:.1%}; alpha {summary['alpha']}); "
        f"{summary['gates_with_discordant_pairs']} gates saw discordant pairs "
        f"({summary['repairs']} repairs, {summary['regressions']} regressions in all); "
        f"baseline arm {solved}/{dev_tasks} dev tasks solved; "
        f"{summary['candidate_rollouts']} candidate rollouts, "
        f"{summary['wall_seconds']:.0f} s"
    )
    write_result("aa_gate", summary, opts)
