"""Learning from use, simulated: the units agent serves a stream of new questions through
`ratchet gateway`, a share of its users say what the right answer was, and the next scheduled
generation learns from them. Held out before and after, beside the same generation without them.

    .venv/bin/python -m bench traffic_learning [--questions 160] [--expected 0.6]

The agent is the units example's plain openai agent with the example's own settings
(examples/units/openai.toml). The stream is new: questions phrased in ways the task file never
uses ("Quick question: 12 feet is how many inches?"), answered as the file's scorer checks.
A question's split is its learned item's (`flows/traffic.py:item_id`, the task file's hash):

1. generation 0 (`ratchet evolve`'s baseline) on a fresh data dir;
2. the gateway (`--temperature 0`, the base model: nothing is promoted yet) answers every
   stream question once; on the train and dev ones a simulated user sends
   `POST /v1/feedback` with the verdict, and on a share (`--expected`) the right answer too;
   the test ones get nothing: they are the production held-out set;
3. the data dir is copied: arm `learn` runs generation 1 with `traffic.learn = true` (its
   `collect` stage turns the feedback into tasks), arm `plain` the same generation without;
4. each arm's champion answers the production held-out set through the gateway; the task
   file's 50 test tasks are each arm's own evaluate (the journal).

Reported: both held-out sets per arm before and after with paired sign tests (each arm against
generation 0, and `learn` against `plain`), what each arm promoted, and what `collect` found.
Writes bench/results/<name>.json.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.gateway_overhead import GatewayProcess
from bench.harness import ROOT, embedded_server, fresh_data_dir, option, paired, write_result

EXAMPLE = ROOT / "examples" / "units"
PHRASINGS = [
    "Quick question: {value} {frm} is how many {to}?",
    "Can you tell me what {value} {frm} comes to in {to}?",
    "I need {value} {frm} expressed as {to}, please.",
    "{value} {frm} equals how many {to}?",
]


@dataclass
class Options:
    questions: int = option(160, "new questions in the stream")
    expected: float = option(0.6, "share of train and dev questions whose user gives the right answer")
    seed: int = option(2026, "seed of the stream")
    work: Path | None = option(None, "resume the run in this work dir (each finished phase is kept)")
    name: str = option("traffic_learning", "results file name under bench/results")


def stream(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` new unit questions in phrasings the task file never uses, each with its answer."""
    from units import SHORT, UNITS, plural  # the example's own tables

    rng = random.Random(seed)
    by_dim: dict[str, list[str]] = {}
    for unit, (dim, _) in UNITS.items():
        by_dim.setdefault(dim, []).append(unit)
    out, seen = [], set()
    while len(out) < n:
        dim = rng.choice(sorted(by_dim))
        frm, to = rng.sample(by_dim[dim], 2)
        value = rng.choice([rng.randint(2, 95), round(rng.uniform(1, 50), 1)])
        word = SHORT[frm] if frm in SHORT and rng.random() < 0.25 else plural(frm)
        question = rng.choice(PHRASINGS).format(value=value, frm=word, to=plural(to))
        if question not in seen:
            seen.add(question)
            out.append({"input": question, "answer": value * UNITS[frm][1] / UNITS[to][1]})
    return out


def settings_for(data: Path, learn: bool) -> Any:
    from ratchet.config import load_settings
    from ratchet.runtime_env import prepare_environment

    settings = load_settings({"data_dir": data, "traffic.learn": learn}, config_file=EXAMPLE / "openai.toml")
    prepare_environment(settings)
    return settings


def play(settings: Any, gateway_url: str, questions: list[dict[str, Any]]) -> dict[str, bool]:
    """Each question answered by the agent through the gateway, scored by the example's scorer."""
    from score import score

    from ratchet.endpoint.entry import YourAgent
    from ratchet.flows.traffic import item_id

    agent = YourAgent(settings.agent)
    out = {}
    for q in questions:
        try:
            answer = agent.run(q["input"], gateway_url, settings.tasks.max_steps)
            out[item_id(q["input"])] = bool(score(q, answer))
        except Exception as exc:  # noqa: BLE001 - a failed answer, as the endpoint's runner counts it
            print(f"  {q['input']!r}: {type(exc).__name__}: {exc}", flush=True)
            out[item_id(q["input"])] = False
    return out


def latest_traces(settings: Any, wanted: set[str], wait_s: float = 120) -> dict[str, str]:
    """The latest gateway trace of each question in `wanted`, by its first user message (the
    gateway's process exports traces in the background: waits until all are there)."""
    import mlflow

    from ratchet.flows import tracking
    from ratchet.skills.calls import task_text

    exp = tracking.setup_experiment(settings)
    deadline = time.monotonic() + wait_s
    while True:
        found: dict[str, tuple[int, str]] = {}
        for t in mlflow.search_traces(
            locations=[exp], filter_string="tags.`ratchet.source` = 'gateway'", return_type="list"
        ):
            spans = t.data.spans
            text = task_text(spans[0].inputs.get("messages", [])) if spans else ""
            at = int(t.info.request_time or 0)
            if text in wanted and at >= found.get(text, (-1, ""))[0]:
                found[text] = (at, t.info.trace_id)
        if set(found) >= wanted or time.monotonic() > deadline:
            return {k: v[1] for k, v in found.items()}
        time.sleep(2)


def give_feedback(
    gw: GatewayProcess,
    data: Path,
    settings: Any,
    questions: list[dict[str, Any]],
    verdicts: dict[str, bool],
    share: float,
    seed: int,
) -> dict[str, int]:
    from ratchet.flows.traffic import item_id

    token = (data / "gateway.token").read_text().strip()
    traces = latest_traces(settings, {q["input"] for q in questions})
    rng = random.Random(seed + 1)
    sent = {"feedback": 0, "with_expected": 0, "no_trace": 0}
    for q in questions:
        trace = traces.get(q["input"])
        if trace is None:
            sent["no_trace"] += 1
            continue
        body: dict[str, Any] = {"trace_id": trace, "score": verdicts[item_id(q["input"])], "user": "sim"}
        if rng.random() < share:
            body["expected"] = q["answer"]
            sent["with_expected"] += 1
        got = httpx.post(
            gw.url.removesuffix("/v1") + "/v1/feedback",
            json=body,
            headers={"Authorization": f"Bearer {token}"},
            timeout=120,
        )
        got.raise_for_status()
        sent["feedback"] += 1
    return sent


def through_gateway(
    data: Path, url: str, settings: Any, questions: list[dict[str, Any]], log: Path
) -> dict[str, Any]:
    gw = GatewayProcess(data, url, log, extra=["--temperature", "0", "--allow-base"])
    try:
        version = httpx.get(gw.url.removesuffix("/v1") + "/health", timeout=30).json()["policy"]
        return {"policy": version, "outcomes": play(settings, gw.url, questions)}
    finally:
        gw.stop()


def journal_rows(settings: Any) -> list[dict[str, Any]]:
    from ratchet.flows.journal import Journal

    return [asdict(r) for r in Journal.load(settings).rows()]


def run(opts: Options) -> int:
    from ratchet.flows.evolve import evolve_flow
    from ratchet.flows.traffic import item_id
    from ratchet.suites.task_file import split_of

    os.chdir(EXAMPLE)  # the agent, its tables and the scorer are imported from the example's folder
    sys.path.insert(0, str(EXAMPLE))
    questions = stream(opts.questions, opts.seed)
    held_out = [q for q in questions if split_of(item_id(q["input"])) == "test"]
    served = [q for q in questions if split_of(item_id(q["input"])) != "test"]
    work = opts.work or fresh_data_dir("ratchet-traffic-learning-")
    learn_dir, plain_dir = work / "learn", work / "plain"
    if not learn_dir.exists():
        learn_dir.mkdir()
        (learn_dir / "models").symlink_to((work / "models").resolve(), target_is_directory=True)
    kept = work / "use.json"  # the gateway phase, done once: a resumed run reads it back
    result: dict[str, Any] = {
        "questions": len(questions),
        "held_out": len(held_out),
        "served": len(served),
        "expected_share": opts.expected,
        "timings_minutes": {},
    }
    print(f"data: {work}; {len(served)} questions served with feedback, {len(held_out)} held out", flush=True)
    clock = time.perf_counter()

    def lap(what: str) -> None:
        nonlocal clock
        result["timings_minutes"][what] = round((time.perf_counter() - clock) / 60, 2)
        clock = time.perf_counter()
        write_result(opts.name, result, opts)

    with embedded_server(work / "logs") as url:
        base = settings_for(learn_dir, learn=True)
        evolve_flow(settings=base, generations=0, base_url=url)
        lap("generation 0")
        if not kept.exists():
            gw = GatewayProcess(
                learn_dir,
                url,
                work / "logs" / "gateway-use.log",
                extra=["--temperature", "0", "--allow-base"],
            )
            try:
                before_served = play(base, gw.url, served)
                lap("serve the stream")
                feedback = give_feedback(gw, learn_dir, base, served, before_served, opts.expected, opts.seed)
                lap("feedback")
                before = play(base, gw.url, held_out)
                lap("held out, generation 0")
            finally:
                gw.stop()
            kept.write_text(json.dumps({"served": before_served, "feedback": feedback, "held_out": before}))
        use = json.loads(kept.read_text())
        before = use["held_out"]
        result["served_success_before"] = sum(use["served"].values())
        result["feedback"] = use["feedback"]
        result["held_out_before"] = sum(before.values())
        if not plain_dir.exists():
            ignore = shutil.ignore_patterns("prefect", "logs", "run")
            shutil.copytree(learn_dir, plain_dir, symlinks=True, ignore=ignore)
        arms: dict[str, Any] = {}
        for arm, data in (("learn", learn_dir), ("plain", plain_dir)):
            settings = settings_for(data, learn=arm == "learn")
            evolve_flow(settings=settings, generations=1, base_url=url)
            lap(f"generation 1, {arm}")
            after = through_gateway(data, url, settings, held_out, work / "logs" / f"gateway-{arm}.log")
            lap(f"held out, {arm}")
            rows = journal_rows(settings)
            arms[arm] = {
                "policy": after["policy"],
                "held_out_after": sum(after["outcomes"].values()),
                "held_out_vs_generation_0": paired(
                    {k: float(v) for k, v in before.items()},
                    {k: float(v) for k, v in after["outcomes"].items()},
                ),
                "file_test": [f"{r['test_successes']}/{r['test_n']}" for r in rows],
                "file_test_vs_generation_0": paired(
                    {k: float(v) for k, v in rows[0]["test_by_task"].items()},
                    {k: float(v) for k, v in rows[-1]["test_by_task"].items()},
                ),
                "promoted": [name for r in rows for name in r["promoted"]],
                "outcomes": after["outcomes"],
                "by_task": rows[-1]["test_by_task"],
            }
            if arm == "learn":
                from ratchet.flows.journal import Journal

                arms[arm]["collect"] = [
                    r.summary for r in Journal.load(settings).records if r.stage == "collect"
                ]
            result["arms"] = arms
            write_result(opts.name, result, opts)
    learn, plain = arms["learn"], arms["plain"]
    result["learn_vs_plain"] = {
        "held_out": paired(
            {k: float(v) for k, v in plain["outcomes"].items()},
            {k: float(v) for k, v in learn["outcomes"].items()},
        ),
        "file_test": paired(
            {k: float(v) for k, v in plain["by_task"].items()},
            {k: float(v) for k, v in learn["by_task"].items()},
        ),
    }
    write_result(opts.name, result, opts)
    print(
        f"production held-out ({len(held_out)}): generation 0 {result['held_out_before']}, "
        f"learn {learn['held_out_after']} ({learn['promoted']}), "
        f"plain {plain['held_out_after']} ({plain['promoted']}); "
        f"file test: learn {learn['file_test']}, plain {plain['file_test']}",
        flush=True,
    )
    return 0
