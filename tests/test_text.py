"""Degenerate text: loops are found, cut after their first round, and prose is left alone."""

from __future__ import annotations

import pytest

from ratchet.text import CUT_MARK, cut_repetition, repeats_itself, repetition

LOOP = "one-sentence-error-revised-" * 12 + "one-sente"  # as the dashboard once showed a cause


@pytest.mark.parametrize(
    "text",
    [
        LOOP,
        "The agent went north. " + "go north go north go north go north",
        "error error error error error error",
        "Take the coin, then " + "open the door and look around; " * 4,
        "X" + " repeat after me" * 3,
    ],
)
def test_a_loop_is_found_and_cut_after_its_first_round(text: str) -> None:
    assert repeats_itself(text)
    cut = cut_repetition(text)
    assert cut.endswith(CUT_MARK) and len(cut) < len(text) + len(CUT_MARK)
    assert not repeats_itself(cut.removesuffix(CUT_MARK))  # what is left says it once


def test_the_cut_keeps_what_came_before_the_loop_and_one_round_of_it() -> None:
    assert cut_repetition(LOOP) == "one-sentence-error-revised" + CUT_MARK
    text = "It moved east; " + "go north " * 8
    assert cut_repetition(text) == "It moved east; go north" + CUT_MARK
    start, end = repetition(text) or (0, 0)
    assert text[start:end] == "go north" and text[:start] == "It moved east; "


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Forgot the unit.",
        "It moved north, not east, and then north again.",
        "again and again and again",  # 5 words: a figure of speech, not a loop
        "very very",
        "The answer was 12 but the sum of 3, 4 and 5 is 12.",
        "1. Look at the map. 2. Go to the room the map names. 3. Take the coin.",
        "Do not repeat `move north`; when `move north` was tried, try `move east`.",
    ],
)
def test_prose_is_left_alone(text: str) -> None:
    assert not repeats_itself(text)
    assert cut_repetition(text) == text


def test_only_a_bounded_prefix_is_read() -> None:
    """The work is bounded by the prefix read, whatever the text's length: a loop far past it is
    not looked for (a model's loop starts within its first few hundred tokens)."""
    prose = " ".join(f"w{i}" for i in range(5_000))  # ~34k characters, no loop
    assert not repeats_itself(prose + " go north" * 10)
    assert repeats_itself(" go north" * 10 + prose)


def test_a_looping_cause_is_cut_where_a_diagnosis_is_shown_and_clustered() -> None:
    from ratchet.types import Diagnosis

    d = Diagnosis(
        trajectory_id="t", evolution="e", generation=1, task_id="s:a:train:1", subset="a",
        mode="wrong_answer", cause=LOOP,
    )  # fmt: skip
    assert d.summary() == "a: wrong answer; one-sentence-error-revised" + CUT_MARK


def test_the_judge_discards_a_cause_that_loops() -> None:
    import json

    from langchain_core.messages import AIMessage

    from ratchet.agents.diagnoser import build_diagnoser, judged
    from ratchet.agents.testing import ScriptedChatModel
    from tests.factories import traj

    judge = ScriptedChatModel(script=[AIMessage(content=json.dumps({"cause": "go north then " * 10}))])
    failure = traj(["go north", "go north", "go north"], success=False)
    diagnosis, discarded = judged(build_diagnoser(judge, "judge"), failure, [])
    assert (diagnosis.cause, discarded) == ("", "repeats itself")
