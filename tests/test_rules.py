"""Action rules as the actor applies them: the menu narrows, never empties, and says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.skills.rules import apply_rules, call_text, constrain_tools, matches, menu_entries, normal
from ratchet.types import RuleSpec, ToolCall, ToolSpec, Tried

MENU = ["act: look around", "act: move south", "act: open door to west", "act: take coin"]


@pytest.mark.parametrize(
    ("pattern", "action", "hit"),
    [
        ("act: take coin", "act: take coin", True),
        ("act: take coin", "act: take  Coin", True),  # normal form on both sides
        ("act: take coin", "act: take coins", False),  # whole words, no prefix match
        ("act: take coin", "act: take coin from table", False),  # the whole action
        ("act: open door to *", "act: open door to west", True),
        ("act: open door to *", "act: open door to", False),  # * is at least one word
        ("act: open * to west", "act: open sliding door to west", True),
        ("act: take c.in", "act: take coin", False),  # no regex leaks through
    ],
)
def test_patterns_match_whole_actions_word_by_word(pattern: str, action: str, hit: bool) -> None:
    assert matches(pattern, action) is hit


def test_prefer_forces_the_menu_when_its_action_is_there() -> None:
    rule = RuleSpec(name="coin-prefer-take-coin", prefer=("act: take coin",))
    assert apply_rules([rule], "You see a coin.", MENU) == (["act: take coin"], ["coin-prefer-take-coin"])
    rest = [a for a in MENU if a != "act: take coin"]
    assert apply_rules([rule], "A kitchen.", rest) == (rest, [])  # not on the menu: nothing fires


def test_when_gates_a_rule_on_the_observation() -> None:
    rule = RuleSpec(name="r", prefer=("act: take coin",), when=("coin",))
    assert apply_rules([rule], "Nothing here.", MENU) == (MENU, [])
    assert apply_rules([rule], "You see a COIN.", MENU)[0] == ["act: take coin"]


def test_avoid_removes_but_never_empties_the_menu() -> None:
    rule = RuleSpec(name="no-look", avoid=("act: look around",))
    assert apply_rules([rule], "", MENU) == (MENU[1:], ["no-look"])
    assert apply_rules([rule], "", ["act: look around"]) == (["act: look around"], [])


def test_no_repeat_takes_off_what_was_already_tried_from_this_observation() -> None:
    rule = RuleSpec(name="no-repeat", no_repeat=True)
    tried = [Tried("a kitchen.", "act: move south"), Tried("a pantry.", "act: take coin")]
    kept, fired = apply_rules([rule], "A  Kitchen.", MENU, tried)
    assert kept == [a for a in MENU if a != "act: move south"] and fired == ["no-repeat"]
    assert apply_rules([rule], "A hallway.", MENU, tried) == (MENU, [])  # another state: all untried


def test_rules_apply_in_name_order_and_each_firing_is_named_once() -> None:
    rules = [
        RuleSpec(name="b-prefer", prefer=("act: move south", "act: take coin")),
        RuleSpec(name="a-avoid", avoid=("act: take coin",)),
    ]
    assert apply_rules(rules, "", MENU) == (["act: move south"], ["a-avoid", "b-prefer"])


def _act(valid: list[str]) -> ToolSpec:
    return ToolSpec(
        name="act",
        description="Take one action.",
        parameters={
            "type": "object",
            "properties": {"action": {"type": "string", "enum": valid, "description": "verbatim"}},
            "required": ["action"],
        },
    )


def test_constrain_tools_narrows_the_enum_and_keeps_the_original_spelling() -> None:
    answer = ToolSpec(name="answer", description="Answer.", parameters={"type": "object", "properties": {}})
    tools = [_act(["look around", "Take Coin"]), answer]
    rule = RuleSpec(name="r", prefer=("act: take coin",))
    out, fired = constrain_tools(tools, [rule], "You see a coin.")
    assert out[0].parameters["properties"]["action"]["enum"] == ["Take Coin"]  # what the env accepts
    assert out[0].parameters["properties"]["action"]["description"] == "verbatim"
    assert fired == ["r"] and len(out) == 1  # forced: the other tool is not on the menu either
    assert tools[0].parameters["properties"]["action"]["enum"] == ["look around", "Take Coin"]  # not mutated
    assert constrain_tools(tools, [], "x") == (tools, [])
    avoid = RuleSpec(name="a", avoid=("act: look around",))
    assert constrain_tools(tools, [avoid], "")[0][1] == answer  # a tool without an enum is left alone


def _free(name: str, *params: str) -> ToolSpec:
    props = {p: {"type": "string"} for p in params}
    return ToolSpec(name=name, description=name, parameters={"type": "object", "properties": props})


CALC, ANSWER = _free("calculator", "expression"), _free("answer", "answer")


def test_rules_act_on_tool_choice_where_nothing_is_enumerated() -> None:
    first = RuleSpec(name="calc-first", prefer=("calculator: *",), when=("premises",))
    out, fired = constrain_tools([CALC, ANSWER], [first], "Given the premises P and Q, what follows?")
    assert (out, fired) == ([CALC], ["calc-first"])  # the first move is a calculation
    assert constrain_tools([CALC, ANSWER], [first], "2 + 3 = 5") == ([CALC, ANSWER], [])  # then free
    never = RuleSpec(name="no-calc", avoid=("calculator: *",))
    assert constrain_tools([CALC, ANSWER], [never], "") == ([ANSWER], ["no-calc"])
    # a rule that would leave no tool at all does not act
    assert constrain_tools([CALC], [never], "") == ([CALC], [])
    # a specific call is not the tool: avoiding one expression does not take the calculator away
    assert constrain_tools([CALC, ANSWER], [RuleSpec(name="x", avoid=("calculator: 1 + 1",))], "")[1] == []


def test_a_tool_without_parameters_is_one_action_and_no_repeat_sees_it() -> None:
    look = _free("look")
    rule = RuleSpec(name="no-loop", no_repeat=True)
    tried = [Tried(normal("A hall."), call_text(ToolCall(name="look", args={})))]
    assert constrain_tools([look, ANSWER], [rule], "A hall.", tried) == ([ANSWER], ["no-loop"])
    assert constrain_tools([look, ANSWER], [rule], "A cellar.", tried) == ([look, ANSWER], [])


def test_enumerated_and_free_tools_share_one_menu() -> None:
    tools = [_act(["look around", "take coin"]), CALC]
    out, fired = constrain_tools(tools, [RuleSpec(name="p", prefer=("calculator: *",))], "")
    assert (out, fired) == ([CALC], ["p"])  # every enumerated action left: the tool is not offered
    out, _ = constrain_tools(tools, [RuleSpec(name="q", avoid=("act: look around",))], "")
    assert out[0].parameters["properties"]["action"]["enum"] == ["take coin"] and out[1] == CALC


def test_call_text_is_the_attributions_normal_form() -> None:
    from ratchet.diagnosis.attribution import normalize_action
    from ratchet.types import Step

    call = ToolCall(name="act", args={"action": "Take   Coin"})
    assert (
        call_text(call) == normalize_action(Step(index=0, observation="", tool_call=call)) == "act: take coin"
    )


def _macro(first: str = "act: move {a}", b: tuple[str, ...] = ("coin", "key")) -> ToolSpec:
    """A macro as the toolsmith writes one: `a` bound to the menu, `b` what was seen, both required."""
    a = {"type": "string", "description": "e.g. north", "x-ratchet-menu": first}
    params = {
        "type": "object",
        "properties": {"a": a, "b": {"type": "string", "enum": list(b)}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    return ToolSpec(name="macro", description="m", parameters=params)


def test_a_macro_parameter_bound_to_the_menu_takes_only_playable_values() -> None:
    from ratchet.skills.rules import MENU_KEY, bind_to_menu

    env = _act(["move east", "Move West", "take coin", "move to the north wing"])
    out = bind_to_menu([env, _macro()])
    a = out[1].parameters["properties"]["a"]
    assert a["enum"] == ["east", "west", "to the north wing"]  # any value that plays now, not only "north"
    assert MENU_KEY not in a and a["description"] == "e.g. north"  # plain JSON schema leaves ratchet
    assert out[1].parameters["properties"]["b"]["enum"] == ["coin", "key"]  # later actions: what was seen
    assert out[0] == env
    assert bind_to_menu([_act(["take coin"]), _macro()]) == [
        _act(["take coin"])
    ]  # nowhere to move: not offered
    assert bind_to_menu([_act(["move east"]), _macro("act: {a} {a}")])[1:] == []  # a template it cannot read


def test_a_bound_macro_goes_through_the_rules_menu_like_any_tool() -> None:
    from ratchet.skills.rules import bind_to_menu

    tools = bind_to_menu([_act(["move east", "take coin"]), _macro()])
    out, fired = constrain_tools(tools, [RuleSpec(name="p", prefer=("act: take coin",))], "")
    assert [t.name for t in out] == ["act"] and fired == ["p"]
    # both parameters enumerated: one entry per combination, values in parameter-name order
    assert menu_entries(tools)[2:] == ["macro: east, coin", "macro: east, key"]
    assert constrain_tools(tools, [RuleSpec(name="x", avoid=("macro: *",))], "")[0] == tools[:1]


def test_no_repeat_takes_a_macros_repeated_combination_and_only_that_off_the_menu() -> None:
    """The loop of every held-out failure of three coin generations: a two-move macro that
    walks there and back (`east, west`), called again from the state it led back to. Only
    that combination leaves; the grammar gets the rest as an `anyOf`."""
    from ratchet.skills.rules import bind_to_menu

    tools = bind_to_menu([_act(["move east", "move west"]), _macro(b=("north", "west"))])
    rule = RuleSpec(name="n", no_repeat=True)
    tried = [Tried(normal("Kitchen."), "macro: east, west"), Tried(normal("Hall."), "macro: west, north")]
    out, fired = constrain_tools(tools, [rule], "Kitchen.", tried)
    assert fired == ["n"]
    assert menu_entries(out)[2:] == ["macro: east, north", "macro: west, north", "macro: west, west"]
    params = out[1].parameters
    assert params["properties"] == tools[1].parameters["properties"]  # the prompt lists the same parameters
    assert [(b["properties"]["a"]["enum"], b["properties"]["b"]["enum"]) for b in params["anyOf"]] == [
        (["east"], ["north"]),
        (["west"], ["north", "west"]),
    ]
    assert all(b["required"] == ["a", "b"] and b["additionalProperties"] is False for b in params["anyOf"])
    # a second pass (search's untried-only menu) reads the narrowed combinations, not the enums
    again, _ = constrain_tools(
        out, [rule], "Kitchen.", [*tried, Tried(normal("Kitchen."), "macro: west, west")]
    )
    assert menu_entries(again)[2:] == ["macro: east, north", "macro: west, north"]
    # every combination of the values left: written into the enums, no anyOf
    single = again[1].parameters
    assert "anyOf" not in single and single["properties"]["b"]["enum"] == ["north"]
    assert single["properties"]["a"]["enum"] == ["east", "west"]
    every = [Tried(normal("Kitchen."), e) for e in menu_entries(again)[2:]]
    gone, _ = constrain_tools(again, [rule], "Kitchen.", every)
    assert [t.name for t in gone] == ["act"]  # nothing of it left untried here: not offered


@pytest.mark.integration
def test_a_narrowed_macro_is_enforced_by_the_servers_grammar(base_model_dir: Path) -> None:
    """The `anyOf` is what the server's grammar compiles, with the shipped model's tokenizer:
    the removed combination cannot be decoded, the kept ones can."""
    import json

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from ratchet.server.engine import compile_json_schema
    from ratchet.skills.rules import bind_to_menu
    from ratchet.toolcalls import tool_call_schema

    tools = bind_to_menu([_act(["move east", "move west"]), _macro(b=("north", "west"))])
    out, _ = constrain_tools(
        tools, [RuleSpec(name="n", no_repeat=True)], "K", [Tried("k", "macro: east, west")]
    )
    tok = AutoTokenizer.from_pretrained(base_model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    grammar = compile_json_schema(
        xgr.GrammarCompiler(info), json.dumps(tool_call_schema([t.to_openai() for t in out], False))
    )

    def decodes(a: str, b: str) -> bool:
        m = xgr.GrammarMatcher(grammar)
        text = json.dumps({"name": "macro", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.accept_token(
            tok.eos_token_id
        )

    assert not decodes("east", "west")
    assert decodes("east", "north") and decodes("west", "west") and decodes("west", "north")
    assert not decodes("north", "west")  # not on the menu at all


def test_a_tool_with_too_many_combinations_or_a_free_parameter_stays_one_entry() -> None:
    from ratchet.skills.rules import MAX_GRID

    wide = ToolSpec(
        name="convert",
        description="c",
        parameters={
            "type": "object",
            "properties": {
                k: {"type": "string", "enum": [f"u{i}" for i in range(9)]} for k in ("src", "dst")
            },
            "required": ["src", "dst"],
        },
    )
    assert 9 * 9 > MAX_GRID and menu_entries([wide]) == ["convert: *"]
    free = _macro().model_copy(
        update={
            "parameters": _macro().parameters
            | {"properties": {"a": {"type": "string"}, "b": {"type": "string", "enum": ["x"]}}}
        }
    )
    assert menu_entries([free]) == ["macro: x"]  # one enumerated parameter: its values, as before
    odd = {"type": "string", "enum": [{"x": 1}, [2]]}  # a user's tool: values that are no menu
    hostile = free.model_copy(
        update={
            "parameters": free.parameters | {"properties": {"a": odd, "b": {"type": "string", "enum": ["x"]}}}
        }
    )
    assert menu_entries([hostile]) == ["macro: *"]
    tools = [_act(["look around"]), hostile]
    called = Tried("s", call_text(ToolCall(name="macro", args={"a": {"x": 1}, "b": "x"})))
    assert constrain_tools(tools, [RuleSpec(name="n", no_repeat=True)], "s", [called]) == (tools, [])
