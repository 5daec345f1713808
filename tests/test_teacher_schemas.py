"""Every schema a teacher answers in is bounded by the grammar the server constrains it with.

pydantic checks `max_length` after the fact; the grammar is what stops the model while it
writes. Where the two disagree, a small model can write a string longer than the validator
accepts until its token budget runs out, and the answer is lost (xgrammar ignores
`maxLength` beside a `pattern`; the shipped model did exactly this with a skill's name).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr
from pydantic import BaseModel

from ratchet.agents.diagnoser import Judgement
from ratchet.agents.distiller import WrittenSkill, slug
from ratchet.agents.rule_proposer import ProposedRule
from ratchet.agents.structured import SkillName
from ratchet.agents.toolsmith import WrittenCode
from ratchet.server.engine import compile_json_schema

TEACHER_SCHEMAS = [Judgement, WrittenSkill, ProposedRule, WrittenCode]
# The grammar is over characters; a tiny vocabulary is enough to ask it what it admits.
COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b"]), max_threads=1)


def _strings(node: Any, where: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every string-typed subschema, with where it sits."""
    if isinstance(node, list):
        return [s for i, item in enumerate(node) for s in _strings(item, f"{where}[{i}]")]
    if not isinstance(node, dict):
        return []
    found = [(where, node)] if node.get("type") == "string" else []
    for key, value in node.items():
        found += _strings(value, f"{where}.{key}")
    return found


def _admits(schema: dict[str, Any], value: str) -> bool:
    matcher = xgr.GrammarMatcher(compile_json_schema(COMPILER, json.dumps(schema)))
    return matcher.accept_string(json.dumps(value)) and matcher.is_completed()


@pytest.mark.parametrize("model", TEACHER_SCHEMAS, ids=lambda m: m.__name__)
def test_no_string_the_grammar_admits_is_longer_than_the_validator_accepts(model: type[BaseModel]) -> None:
    fields = _strings(model.model_json_schema())
    assert fields, f"{model.__name__} has no string field"
    for where, field in fields:
        bound = field.get("maxLength")
        assert bound is not None, f"{model.__name__}{where} is an unbounded string"
        # Runaway text is repetitive: a long run of one letter is what a looping model writes.
        assert not _admits(field, "a" * (bound + 1)), f"{model.__name__}{where}: the grammar admits more"
        assert not _admits(field, "a" * 4 * bound), f"{model.__name__}{where}: the grammar admits more"


def test_a_skill_name_is_bounded_by_its_pattern_and_admits_what_the_validator_does() -> None:
    """And every name the algorithmic draft makes is one the teacher could have written."""
    (field,) = [f for _, f in _strings(ProposedRule.model_json_schema()) if "pattern" in f]
    at_bound = "-".join(["abcdefghijklmnop"] * 6)
    assert len(at_bound) == field["maxLength"] == 101
    assert _admits(field, at_bound) and _admits(field, "coin-take-it")
    for bad in ["a" * 17, at_bound + "-a", "Coin", "coin--take", "coin-"]:
        assert not _admits(field, bad), bad
    # the validator agrees with the grammar on every probe
    from pydantic import TypeAdapter

    names = TypeAdapter(SkillName)
    assert names.validate_python(at_bound) == at_bound
    long = slug("propositional_logic", "avoid", "a-runaway-answer-that-goes-on", "x" * 30)
    assert names.validate_python(long) == long and _admits(field, long)
    for bad in ["a" * 17, at_bound + "-a"]:
        with pytest.raises(ValueError):
            names.validate_python(bad)


@pytest.mark.parametrize(
    ("pattern", "bounded"),
    [
        ("^[a-z]+$", "^[a-z]{1,5}$"),
        ("[A-Z]*", "[A-Z]{0,5}"),
        (r"^\d+$", r"^\d{1,5}$"),
        ("^.+$", "^.{1,5}$"),
        (r"^[^\]x]+$", r"^[^\]x]{1,5}$"),  # an escaped bracket inside the class
    ],
)
def test_a_repeated_atoms_length_bound_moves_into_its_pattern(pattern: str, bounded: str) -> None:
    from ratchet.server.schema_bounds import bounded_pattern

    assert bounded_pattern(pattern, None, 5) == bounded
    field = {"type": "string", "pattern": pattern, "maxLength": 5}
    sample = {"^[a-z]+$": "a", "[A-Z]*": "A", r"^\d+$": "7", "^.+$": "a", r"^[^\]x]+$": "a"}[pattern]
    assert _admits(field, sample * 5) and not _admits(field, sample * 6) and not _admits(field, sample * 40)


def test_length_bounds_the_pattern_cannot_carry_are_left_as_written() -> None:
    from ratchet.server.schema_bounds import bound_patterns, bounded_pattern

    for pattern in ["^(ab)+$", "^[a-z]+-[a-z]+$", "^a|b+$", r"^\w+\s\w+$", "^[a-z]{2,9}$"]:
        assert bounded_pattern(pattern, None, 5) is None, pattern
    assert bounded_pattern("^[a-z]+$", None, None) is None  # no bound, nothing to move
    assert bounded_pattern("^[a-z]*$", 3, None) == "^[a-z]{3,}$"
    assert bounded_pattern("^[a-z]+$", 9, 5) is None  # contradictory: the validator's to refuse
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "pattern": "^[A-Za-z ]+$", "maxLength": 12},
            "pattern": {"type": "string", "maxLength": 3},  # a property named like the keyword
            "mode": {"enum": [{"pattern": "^x+$", "maxLength": 1}]},  # a value, not a schema
        },
    }
    out = bound_patterns(schema)
    assert out["properties"]["city"]["pattern"] == "^[A-Za-z ]{1,12}$"
    assert out["properties"]["pattern"] == {"type": "string", "maxLength": 3}
    assert out["properties"]["mode"] == schema["properties"]["mode"]
    assert schema["properties"]["city"]["pattern"] == "^[A-Za-z ]+$"  # the caller's schema unchanged
    # through the server's compile: a city can no longer run past its bound
    city = out["properties"]["city"] | {"pattern": "^[A-Za-z ]+$"}
    assert _admits(city, "New York") and not _admits(city, "a" * 13)


def test_an_answer_cut_at_the_token_limit_is_no_answer_and_no_console_warning(caplog) -> None:  # type: ignore[no-untyped-def]
    """The shipped model, as teacher, sometimes writes until its token limit inside a JSON
    string; the client raises. That is a bad answer like any other (the draft stands), logged
    at INFO in the data dir's log, not a WARNING on a scheduled run's console."""
    import logging

    from openai import LengthFinishReasonError
    from openai.types.chat import ChatCompletion
    from openai.types.completion_usage import CompletionUsage

    from ratchet.agents.structured import ask_json
    from ratchet.agents.testing import ScriptedChatModel

    cut = ChatCompletion(
        id="c",
        choices=[],
        created=0,
        model="m",
        object="chat.completion",
        usage=CompletionUsage(completion_tokens=387, prompt_tokens=291, total_tokens=678),
    )
    llm = ScriptedChatModel(script=[LengthFinishReasonError(completion=cut)])
    with caplog.at_level(logging.INFO, logger="ratchet.agents.structured"):
        assert ask_json(llm, [], Judgement) is None
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "ran out of tokens (387)" in record.getMessage()
    broken = ScriptedChatModel(script=[RuntimeError("the endpoint said something odd")])
    with caplog.at_level(logging.INFO, logger="ratchet.agents.structured"):
        assert ask_json(broken, [], Judgement) is None
    assert caplog.records[-1].levelno == logging.WARNING  # anything else still warns
