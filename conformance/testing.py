"""The suite conformance kit as pytest tests: subclass `SuiteConformance` in your test suite.

    from ratchet.conformance.testing import SuiteConformance

    class TestMySuite(SuiteConformance):
        suite_spec = "my-suite"            # what `ratchet -s` takes: 'name' or 'name:subset,subset'
        tasks_per_split = 3                # tasks of each subset and split the checks look at
        tokenizer = None                   # whose tokens the output budget is counted in:
                                           # None = the shipped model's; or a tokenizer dir or name

One test per check of `ratchet.conformance.suite` (a failure says which promise broke and
on which task, a check that cannot run here is skipped with why); the suite is built once
per class. Override the classmethod `make_suite` to build it yourself (e.g. from a test
fixture's data). Needs pytest; the checks themselves do not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from ratchet.conformance.budget import kit_options
from ratchet.conformance.suite import CHECKS, CheckSkipped, ConformanceError
from ratchet.suites import Suite, get_suite


class SuiteConformance:
    suite_spec: ClassVar[str] = ""
    tasks_per_split: ClassVar[int] = 3
    tokenizer: ClassVar[Any] = None  # see `check_suite(tokenizer=...)`
    max_tokens: ClassVar[int | None] = None  # the budget of a task that sets none (`model.max_tokens`)

    @classmethod
    def make_suite(cls) -> Suite:
        if not cls.suite_spec:
            raise NotImplementedError("set suite_spec (e.g. 'my-suite') or override make_suite")
        return get_suite(cls.suite_spec)

    @pytest.fixture(scope="class")
    @classmethod
    def suite(cls) -> Iterator[Suite]:
        suite = cls.make_suite()
        try:
            yield suite
        finally:
            suite.close()

    def _check(self, name: str, suite: Suite) -> None:
        """A broken promise fails in one line; any other exception keeps its traceback (a bug)."""
        cls = type(self)  # a function set as `tokenizer` stays a plain function (never bound to self)
        with kit_options(cls.tokenizer, cls.max_tokens):
            try:
                CHECKS[name](suite, self.tasks_per_split)
            except CheckSkipped as exc:
                pytest.skip(f"{name}: {exc}")
            except ConformanceError as exc:
                pytest.fail(f"{name}: {exc}", pytrace=False)

    def test_ids_replay(self, suite: Suite) -> None:
        self._check("ids_replay", suite)

    def test_split_sizes_declared(self, suite: Suite) -> None:
        self._check("split_sizes_declared", suite)

    def test_splits_fixed_and_disjoint(self, suite: Suite) -> None:
        self._check("splits_fixed_and_disjoint", suite)

    def test_tool_schemas(self, suite: Suite) -> None:
        self._check("tool_schemas", suite)

    def test_experts_pass(self, suite: Suite) -> None:
        self._check("experts_pass", suite)

    def test_replies_fit_the_output_budget(self, suite: Suite) -> None:
        self._check("replies_fit_the_output_budget", suite)

    def test_text_replies_where_offered(self, suite: Suite) -> None:
        self._check("text_replies_where_offered", suite)

    def test_wrong_answers_fail(self, suite: Suite) -> None:
        self._check("wrong_answers_fail", suite)

    def test_invalid_input_is_action_error(self, suite: Suite) -> None:
        self._check("invalid_input_is_action_error", suite)

    def test_plays_through_the_actor(self, suite: Suite) -> None:
        self._check("plays_through_the_actor", suite)

    def test_version_declared(self, suite: Suite) -> None:
        self._check("version_declared", suite)

    def test_version_is_stable(self, suite: Suite) -> None:
        self._check("version_is_stable", suite)

    def test_episodes_close_twice(self, suite: Suite) -> None:
        self._check("episodes_close_twice", suite)

    def test_replays_the_same_way(self, suite: Suite) -> None:
        self._check("replays_the_same_way", suite)

    def test_every_check_has_a_test(self) -> None:
        missing = [n for n in CHECKS if not hasattr(self, f"test_{n}")]
        assert not missing, f"checks without a test method: {missing}"
