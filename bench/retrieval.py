"""Skill selection latency: `SkillRetriever.select` over an index of N synthetic skills.

`SkillRetriever.select` (k=3, 400-token budget) over an index of N synthetic skills, for
task-like queries.

    .venv/bin/python -m bench retrieval [--sizes 1000 50000] [--queries 200] [--dir DIR]

The skills are procedures and guardrails for text games and arithmetic, generated
deterministically from templates with varied vocabulary, 70-140 estimated tokens each
(median ~110). Two policies are timed per size, each on `--queries` distinct instructions it
has not seen, so every select embeds its query: the champion (all N skills, all in the
index) and an A/B arm (the same N plus one candidate the index does not hold, embedded in
memory). `embed_query` times embedding alone, on a third set. The champion is then timed
again on its instructions, whose embeddings the retriever has cached by then, as in the loop
where both A/B arms and every rollout of a task share an instruction. Build time is the
time `sync` takes to embed and store N skills (one torch thread). With `--dir` each size's
index is kept in DIR/skills-N and reused by later runs. Goal: p50 <= 20 ms at 50k skills.
Writes bench/results/retrieval.json.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import option, write_result
from ratchet.types import SkillText

# ---------------------------------------------------------------- synthetic skills

ROOMS = "kitchen pantry hallway backyard bedroom living-room bathroom laundry-room garage corridor "
ROOMS += "street supermarket driveway patio cellar attic study office greenhouse workshop"
OBJECTS = "coin key apple book knife red-potato cookbook lamp lantern map banana carrot "
OBJECTS += "coin-purse toolbox shoe mug plate notebook battery umbrella orange cheese"
CONTAINERS = "fridge cupboard drawer chest box shelf counter toolbox wardrobe bookcase bin basket"
GAME_VERBS = "open take put examine look inventory drop chop slice cook read unlock move"
FAILURES = (
    "walking back and forth between two rooms",
    "repeating an action the game rejected",
    "trying to go through a closed door",
    "running out of steps before finishing",
    "dropping the item it was asked to carry",
    "answering before reading the observation",
    "picking an action that is not in the valid list",
    "examining the same object again and again",
    "forgetting which rooms were already visited",
    "putting objects in the wrong order",
)
ARITH = (
    ("addition", "add", "sum"),
    ("subtraction", "subtract", "difference"),
    ("multiplication", "multiply", "product"),
    ("division", "divide", "quotient"),
    ("chain sums", "add and subtract left to right", "running total"),
    ("countdown", "combine the numbers", "target"),
    ("negative numbers", "track the sign", "result"),
    ("fractions", "use a common denominator", "simplified fraction"),
    ("percentages", "convert to a decimal", "percentage"),
    ("order of operations", "evaluate brackets first", "value"),
)
ARITH_SLIPS = (
    "dropping a minus sign",
    "forgetting to carry a ten",
    "borrowing from the wrong column",
    "adding instead of subtracting",
    "answering with a decimal when an integer is asked",
    "copying a number wrong from the question",
    "stopping after the first operation",
    "reusing a number twice in countdown",
)


def _pick(rng: random.Random, words: str | tuple[str, ...]) -> str:
    return rng.choice(words.split() if isinstance(words, str) else words).replace("-", " ")


def _game_skill(rng: random.Random, i: int) -> SkillText:
    game = rng.choice(["coin", "mapreader", "sorting", "cooking", "treasure hunt", "tidy up"])
    obj, room, cont = _pick(rng, OBJECTS), _pick(rng, ROOMS), _pick(rng, CONTAINERS)
    if rng.random() < 0.5:
        verb = _pick(rng, GAME_VERBS)
        name = f"{game}-{verb}-{obj}-{i}".replace(" ", "-")
        desc = f"How to {verb} the {obj} in {game} games when it may be in the {room} or the {cont}."
        steps = [
            f"Look around the {room} and read every exit before moving.",
            f"If the {cont} is closed, open the {cont} and examine what is inside.",
            f"{verb.capitalize()} the {obj} as soon as it appears in the observation.",
            f"Go {rng.choice(['north', 'south', 'east', 'west'])} only through open doors; "
            "open a closed door first.",
            f"Keep a list of visited rooms; after {rng.randint(3, 9)} rooms without the {obj}, return "
            f"to the {_pick(rng, ROOMS)}.",
            f"Check the inventory after taking the {obj} so you know it is carried.",
            f"In {game}, finish with the goal action instead of exploring further.",
        ]
        body = "\n".join(f"{n}. {s}" for n, s in enumerate(rng.sample(steps, rng.randint(3, 5)), 1))
    else:
        failure = rng.choice(FAILURES)
        name = f"{game}-avoid-{failure.split()[0]}-{obj}-{i}".replace(" ", "-")
        desc = f"Guardrail for {game}: stop {failure} while looking for the {obj}."
        body = (
            f"When you notice you are {failure}, stop and re-read the task.\n"
            f"- Do not {_pick(rng, GAME_VERBS)} the {_pick(rng, OBJECTS)} unless the task names it.\n"
            f"- The {obj} is often in the {room}, inside the {cont}; open containers before leaving.\n"
            f"- Allow at most {rng.randint(2, 5)} tries of one action, then choose a different valid action."
        )
    return SkillText(name=name, description=desc, body=body)


def _arith_skill(rng: random.Random, i: int) -> SkillText:
    topic, verb, noun = rng.choice(ARITH)
    a, b, c = rng.randint(2, 999), rng.randint(2, 999), rng.randint(2, 99)
    if rng.random() < 0.5:
        name = f"{topic.replace(' ', '-')}-procedure-{i}"
        desc = f"Step-by-step procedure for {topic}: {verb} carefully and report the {noun}."
        steps = [
            f"Write the numbers in a column, e.g. {a} and {b}, aligned on the units digit.",
            f"{verb.capitalize()} one part at a time and write every intermediate {noun}.",
            f"Use the calculator tool for any step with more than {rng.randint(2, 4)} digits.",
            f"Check the {noun} by estimating: it should be near {round(a, -1)} and {round(b, -1)}.",
            f"For {c} or more terms, keep a running total and re-check it after every "
            f"{rng.randint(2, 5)} terms.",
            "Give only the final answer, as an integer unless the task asks for a fraction.",
        ]
        body = "\n".join(f"{n}. {s}" for n, s in enumerate(rng.sample(steps, rng.randint(3, 5)), 1))
    else:
        slip = rng.choice(ARITH_SLIPS)
        name = f"{topic.replace(' ', '-')}-guard-{slip.split()[0]}-{i}"
        desc = f"Guardrail for {topic}: the model keeps {slip}."
        body = (
            f"Failures in {topic} tasks came from {slip}.\n"
            f"- Before answering, recompute the {noun} a second way (for {a} and {b}, reverse the order).\n"
            f"- If the answer has more than {rng.randint(3, 6)} digits, call the calculator instead.\n"
            f"- Never answer with words or units; the verifier only accepts the {noun}."
        )
    return SkillText(name=name, description=desc, body=body)


def make_skills(n: int, seed: int = 0) -> list[SkillText]:
    """n distinct synthetic skills, the same for the same (n, seed)."""
    rng = random.Random(seed)
    return [(_game_skill if rng.random() < 0.6 else _arith_skill)(rng, i) for i in range(n)]


def make_queries(n: int, seed: int = 1) -> list[str]:
    """n distinct task instructions in the style of TextWorldExpress and reasoning-gym."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.3:
            out.append(
                f"Your task is to find the {_pick(rng, OBJECTS)}. You are in the {_pick(rng, ROOMS)}. "
                f"There is a closed {_pick(rng, CONTAINERS)} here and a door to the "
                f"{rng.choice(['north', 'east'])}."
            )
        elif r < 0.5:
            out.append(
                f"Take the {_pick(rng, OBJECTS)} from the {_pick(rng, ROOMS)} and put it in the "
                f"{_pick(rng, CONTAINERS)} in the {_pick(rng, ROOMS)}. Use the map to plan your route."
            )
        elif r < 0.7:
            terms = " ".join(f"{rng.choice('+-')} {rng.randint(1, 99)}" for _ in range(rng.randint(2, 6)))
            out.append(f"Calculate {rng.randint(1, 99)} {terms}. Give the final answer as an integer.")
        elif r < 0.85:
            nums = ", ".join(str(rng.randint(1, 100)) for _ in range(4))
            out.append(f"Using the numbers {nums}, create an expression that equals {rng.randint(10, 500)}.")
        else:
            out.append(
                f"Sort the {_pick(rng, OBJECTS)}, the {_pick(rng, OBJECTS)} and the {_pick(rng, OBJECTS)} by "
                f"weight and place the lightest in the {_pick(rng, CONTAINERS)}; carry one object at a time."
            )
        out = list(dict.fromkeys(out))
    return out


# ---------------------------------------------------------------- timing


def _ms(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": round(statistics.median(s) * 1000, 2),
        "p95_ms": round(s[min(len(s) - 1, int(0.95 * len(s)))] * 1000, 2),
    }


def bench_size(n: int, queries: list[str], root: Path, k: int, budget: int) -> dict[str, object]:
    from rich.progress import Progress

    from ratchet.memory.retrieval import SkillRetriever
    from ratchet.memory.vector_index import VectorIndex, embed

    skills = make_skills(n)
    path = root / f"skills-{n}"
    meta = path / "bench-build.json"
    index = VectorIndex(path, "bench")
    retriever = SkillRetriever(index)

    t0 = time.perf_counter()
    with Progress() as bar:
        task = bar.add_task(f"embedding {n} skills", total=n)
        added = retriever.sync(
            skills, batch_size=512, progress=lambda done, total: bar.update(task, completed=done)
        )
        bar.update(task, completed=n)
    build_s = time.perf_counter() - t0
    cached = added == 0 and meta.exists()
    if cached:
        build_s = json.loads(meta.read_text())["build_s"]
    elif added == n:
        meta.write_text(json.dumps({"build_s": build_s}))
    assert index.count() >= n

    # Three disjoint sets of distinct instructions, so each pass embeds every query anew.
    n_q = len(queries) // 3
    champion_q, arm_q, embed_q = queries[:n_q], queries[n_q : 2 * n_q], queries[2 * n_q :]
    warmup = "Warm-up: prepare the skill set."

    def timed(policy: list[SkillText], q: str) -> float:
        t = time.perf_counter()
        chosen = retriever.select(q, policy, k, budget)
        assert 0 < len(chosen) <= k
        return time.perf_counter() - t

    candidate = SkillText(
        name="candidate", description="A new guardrail under test", body="Open doors first."
    )
    arm = skills + [candidate]
    embed([warmup])  # loads the model: not part of any timing below
    t0 = time.perf_counter()
    retriever.select(warmup, skills, k, budget)  # prepares the champion's skill set once
    first_ms = (time.perf_counter() - t0) * 1000
    retriever.select(warmup, arm, k, budget)  # and the arm's

    # Interleaved, so that the machine's load (shared, noisy) hits all three alike.
    champion, arm_s, embed_s = [], [], []
    for cq, aq, eq in zip(champion_q, arm_q, embed_q, strict=True):
        champion.append(timed(skills, cq))
        arm_s.append(timed(arm, aq))
        t = time.perf_counter()
        embed([eq])
        embed_s.append(time.perf_counter() - t)
    repeated = [timed(skills, q) for q in champion_q]  # the same instructions again: cached
    row = {
        "size": n,
        "build_s": round(build_s, 1),
        "build_cached": cached,
        "first_select_ms": round(first_ms, 1),
        "champion": _ms(champion),
        "ab_arm": _ms(arm_s),
        "champion_repeated_queries": _ms(repeated),
        "embed_query": _ms(embed_s),
    }
    print(json.dumps(row), flush=True)
    return row


@dataclass
class Options:
    sizes: list[int] = option([1000, 50000], "skills in the index, one row each")
    queries: int = option(200, "distinct instructions per column")
    dir: Path | None = option(None, "keep built indexes here and reuse them")
    k: int = option(3)
    budget: int = option(400, "token budget of the selected skills")


def run(args: Options) -> None:

    root = args.dir or Path(tempfile.mkdtemp(prefix="ratchet-bench-retrieval-"))
    queries = make_queries(3 * args.queries)  # champion, A/B arm, embedding alone
    rows = [bench_size(n, queries, root, args.k, args.budget) for n in args.sizes]
    result = {"k": args.k, "token_budget": args.budget, "queries": args.queries, "sizes": rows}
    write_result("retrieval", result, args)
