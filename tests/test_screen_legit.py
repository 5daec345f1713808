"""The injection screen against the project's own legitimate texts: what the drafting code
writes (procedures, guardrails with every mode's advice), exemplar and rule texts, real task
texts, and ordinary text that merely looks encoded. A false positive drops a good candidate,
so each must pass the screen built from the trajectories it comes from.
"""

from __future__ import annotations

import pytest

from ratchet.agents.diagnoser import build_diagnoser, diagnose
from ratchet.agents.distiller import (
    ADVICE,
    GuardrailJob,
    ProcedureJob,
    draft_guardrail,
    draft_procedure,
    render_body,
)
from ratchet.diagnosis.keys import failure_keys
from ratchet.skills.exemplars import exemplar_skill, pick_demos
from ratchet.skills.mining import mine_patterns
from ratchet.skills.screen import Screen
from ratchet.types import Trajectory
from tests.factories import traj
from tests.test_single_call import diagnosed, weather_family

FAMILY = "textworld-express:coin"


def _wins() -> list[Trajectory]:
    return [
        traj(["look around", "move east", "take coin"], success=True, task=f"{FAMILY}:train:1", tid="a"),
        traj(["move north", "take coin"], success=True, task=f"{FAMILY}:train:2", tid="b"),
        traj(
            ["open door to west", "move west", "take coin"], success=True, task=f"{FAMILY}:train:3", tid="c"
        ),
    ]


def _texts(written, kind: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Every text of a drafted skill the pipeline screens or files."""
    body = render_body(written, kind)
    return [written.name.replace("-", " "), written.description, written.when, *written.steps, body]


def _refused(screen: Screen, texts: list[str], copies: bool = True) -> dict[str, list[str]]:
    return {t: p for t in texts if (p := screen.problems(t, copies=copies))}


def test_drafted_procedures_and_every_guardrail_pass_their_own_screen() -> None:
    wins = _wins()
    fails = [
        traj(["inventory"] * 4, success=False, done=False, max_steps=4, task=w.task_id, tid=f"f{i}")
        for i, w in enumerate(wins)
    ]
    members = [diagnose(build_diagnoser(None), f, [w]) for f, w in zip(fails, wins, strict=True)]
    screen = Screen.from_trajectories(wins + fails)
    texts = _texts(
        draft_procedure(ProcedureJob(FAMILY, mine_patterns(wins), [3, 2, 3], ["a", "b", "c"])), "procedure"
    )
    for mode in ADVICE:  # every failure mode's advice and wording
        texts += _texts(draft_guardrail(GuardrailJob(FAMILY, mode, members)), "guardrail")
    assert len(texts) > 40
    assert _refused(screen, texts) == {}


def test_a_single_call_guardrail_passes_its_own_screen() -> None:
    experts, failures = weather_family()
    ds = diagnosed(experts, failures)
    job = GuardrailJob("fc:weather", "wrong_answer", ds, key=failure_keys(ds, experts + failures)[0])
    screen = Screen.from_trajectories(experts + failures)
    assert _refused(screen, _texts(draft_guardrail(job), "guardrail")) == {}


def test_exemplars_of_real_tasks_and_rule_texts_pass() -> None:
    """Exemplar demos quote their task text (screened with copies allowed), as the distill
    stage does; the suite's own task texts must not read as instructions or encodings."""
    import reasoning_gym

    from ratchet.suites.reasoning_gym import TOOL_HINT, ReasoningGymSuite

    subsets = ReasoningGymSuite.default_subsets
    wins = [
        traj(
            ["calculate: 2 + 3", "answer: 5"],
            success=True,
            task=f"reasoning-gym:{subset}:train:{i}",
            tid=f"{subset}{i}",
            instruction=f"{entry['question']}\n\n{TOOL_HINT}",
        )
        for subset in subsets
        for i, entry in enumerate(reasoning_gym.create_dataset(subset, seed=1, size=3))
    ]
    screen = Screen.from_trajectories(wins)
    parts = []
    for subset in subsets:
        demos = pick_demos(f"reasoning-gym:{subset}", wins, 5)
        skill = exemplar_skill(f"reasoning-gym:{subset}", demos, "e", 0)
        parts += [skill.description, skill.body, *(p for d in demos for p in (d.task, *d.actions))]
    assert _refused(screen, parts, copies=False) == {}
    rules = [
        "An action rule: ratchet applies it to the menu of valid actions before the model chooses "
        "(its data is scripts/rule.json).\n\nNo repeats: at an observation already seen in this episode, "
        "do not take an action already taken from there. Evidence from textworld-express:coin train runs: "
        "18 failed runs in 8 tasks were filed as stagnation (a repeated action loop or a revisited "
        "observation).",
        "no-repeat rule for textworld-express:coin: no repeats",
        "A macro tool: call `coin-macro-move-take` (a); it plays its actions as one step. The code is in "
        "scripts/tool.py.",
        "Solves a chain_sum problem: returns the answer to submit.",
    ]
    assert _refused(Screen.from_trajectories(_wins()), rules) == {}


# Text that looks encoded (escapes, hashes, base64 blobs, emoji with variation selectors,
# leetspeak-like version strings) but hides nothing.
ORDINARY = [
    "Open https://example.com/search?q=coin%20room&page=2 and read the result.",
    "Salt &amp; pepper are on the table &mdash; take the coin first.",
    "Press the ❤️ button, then take the coin 👍🏽.",
    "The file hash is 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08.",
    "Version v1.2.3 of the mp3 player runs on x86_64; water is H2O.",
    "Press Ctrl+C, then type 42 and 1337, then 0x1F.",
    "The flag 🏴\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f marks England.",
    "The image starts iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB and ends there.",
    "Use the regex \\d+ and the escapes \\n and \\x41 in the call.",
    "If the door is locked, unlock it with the key; don't forget the coin.",
    "Cells A1, B2 and C3 hold 4, 5 and 6: add them up.",
    "Reverse the string 'abc' to get 'cba', then submit it.",
    "UUID 123e4567-e89b-12d3-a456-426614174000 names the room; the key is K3Y-9A.",
    "Call get_weather with unit=celsius, city=Paris and date=2024-03-17.",
    "`act: move {a} → act: take coin` (worked on 3 tasks)",
    "Steps: 1) look; 2) take coin; 3) go north | south | east.",
]


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_text_that_looks_encoded_passes(text: str) -> None:
    seen = traj(["look", "take coin"], success=True, results=[text, "You took the coin."])
    assert Screen.from_trajectories([seen]).problems(text, copies=False) == []
    assert Screen().problems(text) == []
