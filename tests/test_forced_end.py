"""A reply the grammar forces to its end is finished without decoding the rest
(`Engine.forced_end`): against the real model, the replies must be exactly those of decoding
every token, in text, finish reason and completeness, while the forwards drop."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration

ACTIONS = ["take coin", "move south", "move north", "open door to west", "inventory", "look around"]


@pytest.fixture(scope="module")
def engines(base_model_dir):
    from ratchet.server.engine import Engine

    jumping, decoding = Engine(base_model_dir), Engine(base_model_dir, forced_end=False)
    yield jumping, decoding
    jumping.close()
    decoding.close()


def _act_grammar(engine, actions: list[str], allow_text: bool = False):  # type: ignore[no-untyped-def]
    from ratchet.toolcalls import tool_call_schema

    tool = {
        "type": "function",
        "function": {
            "name": "act",
            "parameters": {
                "type": "object",
                "properties": {"action": {"type": "string", "enum": actions}},
                "required": ["action"],
            },
        },
    }
    return engine.compile_json_schema(json.dumps(tool_call_schema([tool], allow_text), sort_keys=True))


def _prompt(engine, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You play a text game. Call act."}, {"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


OBSERVATIONS = [
    "You are in the kitchen. You see a coin on the table. To the South you see a hallway.",
    "You are in the hallway. It is dark. To the North you see the kitchen.",
    "You are in the pantry. You see a shelf. The door to the west is closed.",
    "You are carrying nothing. What now?",
]


def _ask(engine, prompt, grammar, **kw):  # type: ignore[no-untyped-def]
    from ratchet.server.engine import GenRequest

    before = engine.stats["forward_steps"]
    r = engine.generate(GenRequest(prompt_ids=prompt, grammar=grammar, **kw))
    return (r.text, r.finish_reason, r.grammar_complete), engine.stats["forward_steps"] - before


def _both(engines, prompt, actions, allow_text=False, **kw):  # type: ignore[no-untyped-def]
    """The same request to the jumping and the decoding engine: both replies, both forwards."""
    return [_ask(e, prompt, _act_grammar(e, actions, allow_text), **kw) for e in engines]


def test_forced_replies_are_the_decoded_replies_with_fewer_forwards(engines):
    jumping = engines[0]
    forwards = {"jump": 0, "decode": 0}
    ends = jumping.stats["forced_ends"]
    for obs in OBSERVATIONS:
        for actions in (ACTIONS, ACTIONS[1:3], ["open door to west"]):  # a branch inside "move", one action
            (a, fa), (b, fb) = _both(engines, _prompt(jumping, obs), actions, max_tokens=48, temperature=0)
            assert a == b
            assert a[1] == "stop" and a[2] and json.loads(a[0])["arguments"]["action"] in actions
            forwards["jump"] += fa
            forwards["decode"] += fb
    # every multi-action reply ended forced; a one-action reply is forced whole before its
    # prefill (the jump at the start), so its stop token is chosen from the prefill's logits
    assert jumping.stats["forced_ends"] - ends == 8
    assert forwards["jump"] * 3 < forwards["decode"]


def test_sampled_replies_are_the_same_for_the_same_seed(engines):
    """Sampling draws nothing for a forced token that decides anything: the skipped draws
    come after the last free choice, so the same seed gives the same reply."""
    jumping = engines[0]
    seen = set()
    for seed in range(8):
        prompt = _prompt(jumping, OBSERVATIONS[0])
        (a, _), (b, _) = _both(engines, prompt, ACTIONS, max_tokens=48, temperature=1.2, seed=seed)
        assert a == b
        seen.add(a[0])
    assert len(seen) > 1  # the seeds did choose differently: the test compared real choices


def test_a_budget_that_ends_inside_the_forced_text_cuts_it_the_same_way(engines):
    jumping = engines[0]
    prompt = _prompt(jumping, OBSERVATIONS[2])
    for budget in (1, 2, 3, 4, 6, 8):
        (a, _), (b, _) = _both(engines, prompt, ["open door to west"], max_tokens=budget, temperature=0)
        assert a == b
    assert a[1] == "stop"  # the largest budget was enough to finish


def test_free_text_is_decoded_and_unchanged(engines):
    """A text reply (`{"content": ...}`) is free up to its closing quote: nothing to jump."""
    jumping = engines[0]
    prompt = _prompt(jumping, "Say hello instead of acting.")
    (a, _), (b, _) = _both(engines, prompt, ACTIONS, allow_text=True, max_tokens=24, temperature=0)
    assert a == b
