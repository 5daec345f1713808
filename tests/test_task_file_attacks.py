"""The task file and the scoring function as an attacker (or a careless export) would hand them
to ratchet: every way a line can be malformed is one `TaskFileError` line naming the file and
the line, never a traceback; a valid file is never refused for what `json.dumps` writes; the
scoring function cannot carry state from one rollout (or one arm of the gate) to the next, and
a verdict that is not a finite number is one `ScoreError` line naming the function and the task.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ratchet.config import TaskFileSettings
from ratchet.errors import RatchetError
from ratchet.suites.task_file import ScoreError, TaskFileError, TaskFileSuite
from ratchet.types import Task


def _suite(tmp_path: Path, body: bytes, score: str = "score:score") -> TaskFileSuite:
    path = tmp_path / "mine.jsonl"
    path.write_bytes(body)
    return TaskFileSuite(TaskFileSettings(file=path, score=score))


def _lines(*items: object) -> bytes:
    """One object a line, as `json.dumps(ensure_ascii=False)` writes them (raw U+2028 and all)."""
    return "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items).encode()


def _refused(suite: TaskFileSuite, line: int, *needles: str) -> str:
    with pytest.raises(TaskFileError) as err:
        _ = suite.items
    message = str(err.value)
    assert "\n" not in message and f"{suite.path}, line {line}" in message, message
    for needle in needles:
        assert needle in message, message
    return message


# ---------------------------------------------------------------- valid files read as written


@pytest.mark.parametrize("brk", ["\u2028", "\u2029", "\x85"], ids=["U+2028", "U+2029", "U+0085"])
def test_a_line_break_str_splitlines_knows_inside_a_string_is_text_not_a_new_line(
    tmp_path: Path, brk: str
) -> None:
    items = [{"id": "a", "input": f"first{brk}second", "answer": f"x{brk}y"}, {"id": "b", "input": "q"}]
    suite = _suite(tmp_path, _lines(*items))
    assert suite.items == {"a": items[0], "b": items[1]}
    assert suite.make_task(suite.subsets[0], _split(suite, "a"), "a").instruction == f"first{brk}second"


def test_line_numbers_count_newlines_only(tmp_path: Path) -> None:
    body = _lines({"id": "a", "input": "x\u2028y\x85z"}) + b"{not json\n"
    _refused(_suite(tmp_path, body), 2, "is not JSON")


def test_windows_line_ends_and_a_byte_order_mark_are_read(tmp_path: Path) -> None:
    body = b"\xef\xbb\xbf" + _lines({"id": "a", "input": "q"}, {"id": "b", "input": "r"}).replace(
        b"\n", b"\r\n"
    )
    assert list(_suite(tmp_path, body).items) == ["a", "b"]


# ---------------------------------------------------------------- malformed lines: one line each


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deep"),
        ('{"id": "a", "input": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deep"),
        ('{"id": "a", "input": ' + "7" * 5_000 + "}", "integer"),
        ('{"id": ' + "7" * 5_000 + ', "input": 1}', "integer"),
        ('{"id": "a", "input": "\\ud800"}', "surrogate"),
        ('{"id": "\\udcff", "input": 1}', "surrogate"),
        ('{"id": "a", "input": 1, "answer": "\\udfff"}', "surrogate"),
        ('"input"', "not a JSON object"),
        ('["input"]', "not a JSON object"),
        ("42", "not a JSON object"),
        ("null", "not a JSON object"),
    ],
    ids=[
        "deep-array",
        "deep-input",
        "huge-int-input",
        "huge-int-id",
        "lone-surrogate-input",
        "lone-surrogate-id",
        "lone-surrogate-other-field",
        "string-holding-input",
        "list-holding-input",
        "number",
        "null",
    ],
)
def test_a_malformed_line_is_one_line_naming_file_and_line(tmp_path: Path, line: str, needle: str) -> None:
    body = _lines({"id": "ok", "input": "fine"}) + line.encode() + b"\n"
    _refused(_suite(tmp_path, body), 2, needle)


def test_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    body = _lines({"id": "ok", "input": "fine"}) + b'{"id": "b", "input": "\xff\xfe"}\n'
    _refused(_suite(tmp_path, body), 2, "UTF-8")


# ---------------------------------------------------------------- the scoring function


@pytest.fixture
def scorer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Write `body` as the scoring function of a module in the working directory; a suite of 20
    items scored by it."""
    monkeypatch.chdir(tmp_path)

    def make(body: str, name: str) -> TaskFileSuite:
        (tmp_path / f"{name}.py").write_text(f"def score(item, answer):\n{body}")
        monkeypatch.delitem(sys.modules, name, raising=False)
        items = [{"id": f"t{i}", "input": f"q{i}", "gold": {"answer": "42"}} for i in range(20)]
        return _suite(tmp_path, _lines(*items), f"{name}:score")

    return make


def _split(suite: TaskFileSuite, key: str) -> str:
    return next(s for s, ids in suite.by_split.items() if key in ids)


def _task(suite: TaskFileSuite) -> Task:
    return suite.tasks("train", 1)[0]


@pytest.mark.parametrize(
    "body",
    [
        "    item['seen'] = item.get('seen', 0) + 1\n    return item['seen'] == 1\n",
        "    item['gold']['answer'] = 'spent'\n    return answer == '42'\n",
        "    item.clear()\n    return answer == '42'\n",
    ],
    ids=["counter-on-the-item", "nested-field-overwritten", "item-emptied"],
)
def test_a_scorer_that_mutates_its_item_scores_every_rollout_alike(scorer, body: str) -> None:  # type: ignore[no-untyped-def]
    suite = scorer(body, f"mutating_{abs(hash(body))}")
    task = _task(suite)
    before = json.loads(json.dumps(suite.items))
    verdicts = [suite.score(task, "42") for _ in range(3)]
    assert verdicts == [(True, 1.0)] * 3  # the champion's arm and the candidate's, in either order
    assert suite.items == before  # the file's items are what the next rollout gets


@pytest.mark.parametrize(
    ("ret", "needle"),
    [
        ("(True, 10**400)", "not a finite number"),
        ("(False, -10**400)", "not a finite number"),
        ("(True, 10**5000)", "not a finite number"),
        ("(True, float('inf'))", "not a finite number"),
        ("(True, float('nan'))", "not a finite number"),
        ("(True, __import__('fractions').Fraction(10**400, 3))", "not a finite number"),
        ("10**5000", "returned int"),
        ("(True, True)", "returned tuple"),
        ("type('R', (), {'__repr__': lambda self: 1 / 0})()", "returned R"),
    ],
    ids=[
        "huge-int",
        "huge-negative-int",
        "int-past-the-str-limit",
        "inf",
        "nan",
        "huge-fraction",
        "huge-int-alone",
        "bool-score",
        "repr-raises",
    ],
)
def test_a_verdict_that_is_not_a_finite_number_is_one_line_naming_function_and_task(
    scorer,
    ret: str,
    needle: str,  # type: ignore[no-untyped-def]
) -> None:
    name = f"verdict_{abs(hash(ret))}"
    suite = scorer(f"    return {ret}\n", name)
    task = _task(suite)
    with pytest.raises(ScoreError) as err:
        suite.score(task, "42")
    message = str(err.value)
    assert "\n" not in message and f"{name}:score" in message and task.id in message, message
    assert needle in message, message
    assert isinstance(err.value, RatchetError)


def test_a_finite_score_of_any_real_type_is_a_float(scorer) -> None:  # type: ignore[no-untyped-def]
    suite = scorer("    return (True, __import__('fractions').Fraction(1, 4))\n", "fraction_ok")
    assert suite.score(_task(suite), "42") == (True, 0.25)
