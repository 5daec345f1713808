"""The pre-flight: every check a run makes on its input before a flow run, a model server or
any new state exists, each failure one line (`RatchetError`).

A run stops at the first problem; `ratchet doctor` runs the same checks through a `Checks`
that goes on past each. Kept out of `flows/runtime.py` and light to import (no actor, no
LangChain client, no MLflow unless the data dir has its store), so the doctor answers in
seconds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence

from ratchet.checks import Checks
from ratchet.config import Settings
from ratchet.endpoint.entry import YourAgent
from ratchet.errors import ConfigError, EndpointError, SuiteVersionError
from ratchet.files import check_regular_file
from ratchet.flows.journal import Journal
from ratchet.memory.trajectory_store import TrajectoryStore, open_store
from ratchet.server.launcher import check_endpoint, check_port_free
from ratchet.server.weights import shipped_gguf
from ratchet.suites import Suite, suite_from
from ratchet.types import SPLITS, Task


def preflight(
    settings: Settings,
    gate: bool = False,
    splits: Sequence[str] = ("train", "test"),
    checks: Checks | None = None,
) -> None:
    """Fail fast on bad input, before a flow run, a model server or any new state exists.

    Cheapest first: the state files already in the data dir (journal, trajectory DB, skill
    audit log, the champion adapter's files), then the settings (`gate`: the dev split is
    large enough for the A/B gate, and the suite has it), the suite and Java, whether the
    suite has `splits` at the sizes set, the endpoint or the port. `checks` (default: stop at
    the first problem) may go on past a problem instead, as `ratchet doctor` does; a check
    that needs what failed is skipped."""
    c = checks if checks is not None else Checks()
    c.run(lambda: check_state_files(settings))
    if gate:
        c.run(lambda: check_dev_size(settings, {"each family": settings.splits.dev}))
        splits = (*splits, "dev") if "dev" not in splits else splits  # the gate plays the dev split
    opened: list[Suite] = []
    suite_ok = False
    if c.run(lambda: opened.append(suite_from(settings))):
        try:
            suite_ok = _check_suite(settings, splits=splits, suite=opened[0], c=c)
        finally:
            opened[0].close()
    if settings.agent.name and not suite_ok:  # no suite to play it on: its entry point alone
        c.run(YourAgent(settings.agent).check)
    if settings.model.endpoint:
        c.run(lambda: check_model_endpoint(settings, settings.model.endpoint))
    else:
        c.run(shipped_gguf)  # the model package is installed
        if settings.model.port:
            c.run(lambda: check_port_free("127.0.0.1", settings.model.port))


def _check_suite(settings: Settings, suite: Suite, splits: Sequence[str], c: Checks) -> bool:
    """The suite's part of the pre-flight: its own check (a task file parsed, its scoring function
    imported), the evolution's stored version, search, the splits at their sizes, your agent.
    False when the suite's own check failed (nothing after it can be asked)."""
    if not c.run(suite.check):
        return False  # a file that does not parse has no version, no splits to count
    if settings.trajectories_db.is_file():

        def same_version() -> None:
            store = open_store(settings.trajectories_db)
            try:
                check_suite_version(store, settings.evolution, suite)
            finally:
                store.close()

        c.run(same_version)
    if settings.explore.search:
        c.run(lambda: check_search(suite))
    for split in splits:
        c.run(lambda split=split: check_split(settings, suite, split))
    c.run(lambda: split_counts(settings, suite))
    if settings.agent.name:
        if settings.explore.search:
            c.run(_no_search_for_your_agent)
        c.run(lambda: your_agent(settings, suite))
    return True


def check_split(settings: Settings, suite: Suite, split: str) -> None:
    """The suite has `split` at the size set (the seeds alone tell; no task is built)."""
    try:
        for subset in suite.subsets:
            suite.split_seeds(subset, split, getattr(settings.splits, split))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"cannot build the {split} split: {exc}", f"lower splits.{split}") from None


def split_counts(settings: Settings, suite: Suite) -> str:
    """What the suite's splits hold against what the settings ask for: a task file's counts are
    a property of that file (a hash of each id picks its split), so another file of the same
    length splits otherwise. '' for a suite that generates its tasks."""
    asked = {s: getattr(settings.splits, s) for s in SPLITS}
    lines = []
    for subset in suite.subsets:
        sizes = suite.split_sizes(subset)
        if all(n is None for n in sizes.values()):
            continue
        has = " / ".join(f"{s} {'any' if sizes[s] is None else sizes[s]}" for s in SPLITS)
        lines.append(f"{suite.name}:{subset} holds {has}")
    if not lines:
        return ""
    uses = " / ".join(f"{s} {n}" for s, n in asked.items())
    return f"{'; '.join(lines)} (splits set: {uses})"


def _no_search_for_your_agent() -> None:
    raise ConfigError(
        "explore.search returns ratchet's actor to stored states; your agent (agent.entry) "
        "starts every task from its beginning",
        "set explore.search = 0",
    )


def check_search(suite: Suite) -> None:
    """Search explore replays stored actions to return to a state (`agents/search.py`): refused
    for a suite whose episodes may not come back the same way."""
    if not suite.replayable:
        raise ConfigError(
            f"explore.search needs episodes that replay; suite {suite.name!r} does not declare "
            "Suite.replayable",
            "set explore.search = 0, or declare replayable = True if its episodes are deterministic",
        )


def check_suite_version(store: TrajectoryStore, evolution: str, suite: Suite) -> None:
    """Refuse to resume an evolution whose rollouts were played on another version of its
    suite: its stored results would be mixed with new ones in every table and gate. Rows
    stored before versions were recorded ('') say nothing and are let through."""
    other = sorted(store.suite_versions(evolution).get(suite.name, set()) - {"", suite.version})
    if other:
        raise SuiteVersionError(
            f"evolution {evolution!r} was played on suite {suite.name} version {other[0]}, and the "
            f"installed suite is version {suite.version}",
            "start a new evolution (--evolution NAME), or reinstall the suite version it was played on",
        )


def check_dev_size(s: Settings, dev: dict[str, int]) -> None:
    """Refuse a dev split (tasks per family) on which the gate could never admit anything."""
    need = math.ceil(math.log2(1 / s.verify.alpha))  # all-repairs on fewer tasks is never significant
    small = sorted(f for f, n in dev.items() if n < need)
    if small:
        raise ConfigError(
            f"the dev split has too few tasks for the gate ({small[0]}: {dev[small[0]]}); even "
            f"{need - 1} repairs out of {need - 1} are not significant at alpha={s.verify.alpha}",
            f"set splits.dev to at least {need} (16 or more gives the gate room to decide)",
        )


def check_state_files(settings: Settings) -> None:
    """Read what earlier runs left (never creating anything): a damaged file is one line now."""
    Journal.load(settings)
    if check_regular_file(settings.trajectories_db, "the trajectory database"):
        store = open_store(settings.trajectories_db)
        try:
            store.check_integrity()
        finally:
            store.close()
    if os.path.lexists(settings.skills_dir):  # none: no audit log to read, and Chroma's client not imported
        from ratchet.skills.library import read_audit  # noqa: PLC0415

        read_audit(settings.skills_dir)
    if (settings.data_dir / "mlflow.db").is_file():  # `may_have_adapters`, without importing MLflow
        from ratchet.training.registry import AdapterRegistry  # noqa: PLC0415 - MLflow: seconds to import

        registry = AdapterRegistry(settings)
        champion = registry.champion()
        if champion is not None:
            registry.checked_path(champion)


def your_agent(settings: Settings, suite: Suite) -> YourAgent:
    """The agent `agent.entry` names, loaded (one line if it cannot be), on a suite whose tasks
    it can answer: a task file, or a suite whose episodes take an answer in words."""
    agent = YourAgent(settings.agent)
    agent.check()
    task = next(iter(_first_tasks(suite)), None)
    if task is None:
        raise ConfigError(f"suite {settings.suite!r} has no task", "give it tasks")
    with suite.episode(task) as episode:
        episode.reset()
        answers = episode.offers_text_reply(0)
    if not answers:
        raise ConfigError(
            f"agent.entry plays tasks that take an answer, and suite {settings.suite!r} takes tool calls",
            "use a task file (tasks.file) or a suite whose tasks are answered in words",
        )
    return agent


def _first_tasks(suite: Suite) -> Iterator[Task]:
    """The first task of each split that has one."""
    for split in SPLITS:
        try:
            yield from suite.tasks(split, 1)[:1]
        except ValueError:
            continue


def check_model_endpoint(settings: Settings, url: str) -> None:
    """The endpoint at `url` answers and serves `model.name`."""
    served = check_endpoint(url, settings.model.api_key.get_secret_value())
    if served and settings.model.name not in served:
        raise EndpointError(
            f"{url} does not serve model {settings.model.name!r} (it serves: {', '.join(served[:5])})",
            "set model.name to one of those",
        )
