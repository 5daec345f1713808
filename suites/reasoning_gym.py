"""reasoning-gym: procedurally generated, verifiable single-answer problems.

A task with seed s is item 0 of `reasoning_gym.create_dataset(name, seed=s, size=1)`.
Generators draw item i from `Random(seed + i)`, so the split seed bases sit 10**6 apart
and a split never hands out more than 10**6 seeds. The agent gets two tools: a safe
`calculator` and `answer`, which ends the episode; success is `score_answer == 1.0`
exactly (wrong answers can earn partial credit such as 0.01).

`reasoning_gym` is imported lazily: it takes about a second and registers 100+ datasets.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import threading
from collections.abc import Callable
from functools import cache, lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ratchet.suites.base import ActionError, Episode, StepResult, Suite
from ratchet.types import SPLITS, Split, Task, ToolCall, ToolSpec

SPLIT_BASES: dict[Split, int] = {"train": 1_000_000, "dev": 2_000_000, "test": 3_000_000}
SEEDS_PER_SPLIT = 1_000_000
MAX_STEPS = 6
EXPRESSION_MAX_LENGTH = 120
ANSWER_MAX_LENGTH = 200
TOOL_HINT = (
    "Use the calculator tool if it helps with arithmetic. When you are done, call the answer "
    "tool with your final answer only."
)

# Seeds used only to measure how long a dataset's answers get (never a split seed).
_PROBE_SEEDS = range(8)

# ---------------------------------------------------------------------------------------
# Safe arithmetic (never eval)
# ---------------------------------------------------------------------------------------

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalcError(ValueError):
    """An expression the calculator refuses: syntax, unsupported element, or too large."""


class _Unknown:
    """A non-numeric part of an expression (a symbol, a call) while screening answers."""


_UNKNOWN = _Unknown()


class _Arithmetic:
    """Evaluate +, -, *, /, //, %, ** and unary +/- on int and float literals, bounded.

    Every intermediate result must stay within `max_abs`; a power is refused before it is
    computed when its exponent or its estimated size is too large. With `symbols=True`,
    names and calls are allowed and evaluate to 'unknown' (used to screen answers).
    """

    def __init__(self, max_abs: float, max_exponent: int, max_bits: int, symbols: bool = False) -> None:
        self.max_abs = max_abs
        self.max_exponent = max_exponent
        self.max_bits = max_bits
        self.symbols = symbols

    def evaluate(self, expression: str) -> Any:
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except (SyntaxError, ValueError) as e:
            raise CalcError(f"cannot parse {expression!r}") from e
        except (RecursionError, MemoryError) as e:
            raise CalcError("expression too deeply nested") from e
        try:
            return self._eval(tree.body)
        except RecursionError as e:
            raise CalcError("expression too deeply nested") from e

    def _eval(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int | float):
                if self.symbols:
                    return _UNKNOWN
                raise CalcError(f"only numbers are allowed, not {value!r}")
            return self._bounded(value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(left, _Unknown) or isinstance(right, _Unknown):
                if isinstance(node.op, ast.Pow) and not isinstance(right, _Unknown):
                    self._check_exponent(right)
                return _UNKNOWN
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                result = _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError as e:
                raise CalcError("division by zero") from e
            except OverflowError as e:
                raise CalcError("result too large") from e
            return self._bounded(result)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            operand = self._eval(node.operand)
            if isinstance(operand, _Unknown):
                return _UNKNOWN
            return self._bounded(_UNARY[type(node.op)](operand))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor) and not self.symbols:
            raise CalcError("'^' is not a power here; use ** for powers")
        if self.symbols:
            # Names, calls, comparisons...: unknown value, but still screen every subtree.
            for child in ast.iter_child_nodes(node):
                self._eval(child)
            return _UNKNOWN
        raise CalcError(f"unsupported element {type(node).__name__!r}: use numbers and + - * / // % **")

    def _check_exponent(self, exponent: Any) -> None:
        if abs(exponent) > self.max_exponent:
            raise CalcError(f"exponent too large (at most {self.max_exponent})")

    def _check_power(self, base: Any, exponent: Any) -> None:
        self._check_exponent(exponent)
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
            if abs(base).bit_length() * exponent > self.max_bits:
                raise CalcError("result too large")

    def _bounded(self, value: Any) -> Any:
        if isinstance(value, complex):
            raise CalcError("result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalcError("result is not finite")
        if abs(value) > self.max_abs:
            raise CalcError("result too large")
        return value


_CALCULATOR = _Arithmetic(max_abs=10**100, max_exponent=1000, max_bits=400)
# Looser bounds, only to keep a verifier (e.g. countdown's sympy parse) from hanging.
_ANSWER_SCREEN = _Arithmetic(max_abs=10**3000, max_exponent=10_000, max_bits=20_000, symbols=True)
_BIG_FACTORIAL = re.compile(r"(\d{5,}|\))\s*!(?!=)")


def calculate(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely; raises CalcError on anything else."""
    if len(expression) > EXPRESSION_MAX_LENGTH:
        raise CalcError(f"expression too long (at most {EXPRESSION_MAX_LENGTH} characters)")
    return _CALCULATOR.evaluate(expression)


def format_number(value: int | float) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".15g")
    return str(value)


def answer_too_costly(answer: str) -> bool:
    """True if a verifier that evaluates the answer symbolically could hang on it.

    Some `score_answer`s run sympy on the answer (countdown: '9**9**9' never returns),
    so huge powers and factorials are refused before scoring. Answers that are not Python
    expressions pass (most are plain text).
    """
    if _BIG_FACTORIAL.search(answer):
        return True
    if "**" not in answer:
        return False
    try:
        _ANSWER_SCREEN.evaluate(answer)
    except CalcError as e:
        return "too large" in str(e) or "too deeply nested" in str(e)
    return False


# ---------------------------------------------------------------------------------------
# reasoning-gym access
# ---------------------------------------------------------------------------------------


@cache
def _registered() -> tuple[str, ...]:
    """Dataset names that build with their default config (skips e.g. 'composite')."""
    from reasoning_gym.factory import DATASETS

    names = []
    for name, (_, config_cls) in sorted(DATASETS.items()):
        try:
            config = config_cls()
            if hasattr(config, "validate"):
                config.validate()
        except Exception:  # noqa: BLE001 - needs a config we cannot guess
            continue
        names.append(name)
    return tuple(names)


def _package_version() -> str:
    try:
        return version("reasoning_gym")
    except PackageNotFoundError:  # pragma: no cover
        return "unknown"


def _dataset(name: str, config: dict[str, Any]) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, **config)


_entry_lock = threading.Lock()


@lru_cache(maxsize=4096)
def _entry(name: str, seed: int) -> dict[str, Any]:
    return _dataset(name, {"seed": seed, "size": 1})[0]


def _cached_entry(name: str, seed: int) -> dict[str, Any]:
    with _entry_lock:  # generators are not known to be thread-safe; items are cheap
        return _entry(name, seed)


@cache
def answer_max_length(name: str) -> int:
    """The `answer` tool's length cap for a dataset: 200, or twice its longest probed answer.

    Some datasets (arc_agi grids, tower_of_hanoi move lists) have answers of thousands of
    characters. The cap is a property of the dataset, measured on seeds outside every
    split, so it says nothing about a particular task's answer.
    """
    longest = 0
    for seed in _PROBE_SEEDS:
        answer = _cached_entry(name, seed).get("answer")
        if isinstance(answer, str):
            longest = max(longest, len(answer))
    return max(ANSWER_MAX_LENGTH, -(-2 * longest // 100) * 100)


class ReasoningGymSuite(Suite):
    """reasoning-gym datasets as tasks; seeds far apart per split."""

    name = "reasoning-gym"
    description = "reasoning-gym procedurally generated problems, verified by score_answer"
    default_subsets = ("basic_arithmetic", "chain_sum", "countdown")
    # bump the number when a change here alters a task or its verdict; the dataset version is
    # part of it, so an upgraded reasoning-gym never resumes an evolution played on the old one
    declared_version = f"1+reasoning-gym-{_package_version()}"

    def split_sizes(self, subset: str) -> dict[Split, int | None]:
        return dict.fromkeys(SPLITS, SEEDS_PER_SPLIT)  # type: ignore[return-value]

    @classmethod
    def available_subsets(cls) -> list[str]:
        return list(_registered())

    def split_seeds(self, subset: str, split: Split, n: int) -> list[int]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        if not 0 <= n <= SEEDS_PER_SPLIT:
            raise ValueError(f"a split has at most {SEEDS_PER_SPLIT} seeds, asked for {n}")
        base = SPLIT_BASES[split]
        return [base + i for i in range(n)]

    def make_task(self, subset: str, split: Split, seed: int) -> Task:
        base = SPLIT_BASES[split]
        if not base <= seed < base + SEEDS_PER_SPLIT:
            raise ValueError(f"seed {seed} is outside the {split} split [{base}, {base + SEEDS_PER_SPLIT})")
        if subset not in self.default_subsets and subset not in _registered():
            raise ValueError(f"unknown reasoning-gym dataset {subset!r}")
        entry = _cached_entry(subset, seed)
        return self.new_task(
            subset,
            split,
            seed,
            instruction=f"{str(entry['question']).strip()}\n\n{TOOL_HINT}",
            max_steps=MAX_STEPS,
            spec={
                "dataset": subset,
                "config": {"seed": seed, "size": 1},
                "index": 0,
                "answer_max_length": answer_max_length(subset),
                "reasoning_gym_version": _package_version(),
            },
        )

    def episode(self, task: Task) -> ReasoningGymEpisode:
        if task.suite != self.name:
            raise ValueError(f"task {task.id!r} is not a {self.name} task")
        return ReasoningGymEpisode(task)


class ReasoningGymEpisode(Episode):
    """One question: any number of calculator calls, then one answer."""

    def __init__(self, task: Task) -> None:
        super().__init__(task)
        spec = task.spec
        with _entry_lock:
            self._dataset = _dataset(spec["dataset"], dict(spec["config"]))
            self._entry = self._dataset[int(spec.get("index", 0))]
        self._max_answer = int(spec.get("answer_max_length", ANSWER_MAX_LENGTH))
        self._done = False

    @property
    def entry(self) -> dict[str, Any]:
        return self._entry

    def reset(self) -> StepResult:
        self._done = False
        return StepResult(observation=self.task.instruction)

    def tools(self) -> list[ToolSpec]:
        return [
            ToolSpec(
                name="calculator",
                description=(
                    "Evaluate an arithmetic expression: numbers, + - * / // % ** and "
                    "parentheses. Returns the value."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "expression": {
                            "type": "string",
                            "maxLength": EXPRESSION_MAX_LENGTH,
                            "description": "e.g. (12 + 7) * 3",
                        }
                    },
                    "required": ["expression"],
                    "additionalProperties": False,
                },
            ),
            ToolSpec(
                name="answer",
                description="Submit your final answer. This ends the task.",
                parameters={
                    "type": "object",
                    "properties": {
                        "answer": {
                            "type": "string",
                            "maxLength": self._max_answer,
                            "description": "the final answer only, in the format the question asks",
                        }
                    },
                    "required": ["answer"],
                    "additionalProperties": False,
                },
            ),
        ]

    def step(self, call: ToolCall) -> StepResult:
        if self._done:
            raise RuntimeError(f"episode for {self.task.id} is already over")
        if call.name == "calculator":
            return self._calculate(call.args.get("expression"))
        if call.name == "answer":
            return self._answer(call.args.get("answer"))
        raise ActionError(f"unknown tool {call.name!r}; use 'calculator' or 'answer'")

    def _calculate(self, expression: Any) -> StepResult:
        if not isinstance(expression, str) or not expression.strip():
            raise ActionError("'calculator' needs an 'expression' string, e.g. '2*(3+4)'")
        try:
            value = calculate(expression)
        except CalcError as e:
            raise ActionError(f"calculator: {e}") from None
        return StepResult(observation=f"{expression.strip()} = {format_number(value)}")

    def _answer(self, answer: Any) -> StepResult:
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = format_number(answer)
        if not isinstance(answer, str):
            raise ActionError("'answer' needs an 'answer' string")
        if len(answer) > self._max_answer:
            raise ActionError(f"answer too long ({len(answer)} characters; at most {self._max_answer})")
        if answer_too_costly(answer):
            raise ActionError("answer contains a power or factorial too large to check; simplify it")
        try:
            score = float(self._dataset.score_answer(answer, self._entry))
        except Exception:  # noqa: BLE001 - a verifier crash on odd input is a wrong answer
            score = 0.0
        self._done = True
        success = score == 1.0
        verdict = "correct" if success else f"not correct (score {score:g})"
        return StepResult(
            observation=f"Answer submitted: {answer!r} is {verdict}.",
            done=True,
            success=success,
            score=score,
            reward=score,
        )

    def expert_actions(self) -> list[ToolCall] | None:
        gold = self._entry.get("answer")
        if self._done or not isinstance(gold, str):
            return None
        return [ToolCall(name="answer", args={"answer": gold})]
