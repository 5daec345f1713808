"""What every flow needs open while it runs: suite, trajectory store, model endpoint, actor.

The endpoint is either the configured one (checked once, with a clear error if it is
unreachable) or the embedded server, started here and stopped when the `with` ends.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from langchain_core.language_models import BaseChatModel

from ratchet.agents.actor import build_actor
from ratchet.agents.model import ToolCallMode, chat_model
from ratchet.config import Settings
from ratchet.endpoint.agent import YourAgent
from ratchet.endpoint.serve import InterventionEndpoint
from ratchet.errors import ConfigError, EndpointError, SuiteVersionError
from ratchet.files import check_regular_file
from ratchet.flows.tracking import audit_logger
from ratchet.kinds import apply_all
from ratchet.memory.retrieval import SkillRetriever
from ratchet.memory.trajectory_store import TrajectoryStore, open_store
from ratchet.memory.vector_index import VectorIndex
from ratchet.runtime_env import prepare_environment
from ratchet.server.launcher import (
    EmbeddedServer,
    check_endpoint,
    check_port_free,
    ensure_adapter,
    probe_tool_calls,
    served_dtype,
)
from ratchet.server.weights import BASE_MODEL_NAME, shipped_gguf
from ratchet.skills.format import Skill
from ratchet.skills.library import SkillLibrary, read_audit
from ratchet.skills.toolbox import Toolbox
from ratchet.suites import Suite, suite_from
from ratchet.training.registry import AdapterRegistry, AdapterVersion, may_have_adapters
from ratchet.types import SPLITS, Policy, Task

log = logging.getLogger(__name__)


@dataclass
class LoopRuntime:
    settings: Settings
    suite: Suite
    store: TrajectoryStore
    base_url: str
    actor: Any
    teacher: BaseChatModel | None = None
    library: SkillLibrary | None = None
    toolbox: Toolbox | None = None
    retriever: SkillRetriever | None = None
    adapter: AdapterVersion | None = None  # the champion adapter, loaded on the endpoint
    model_dtype: str | None = None  # the format the server says it runs in; None: it does not say
    agent: YourAgent | None = None  # your agent (`agent.entry`) in place of the actor
    endpoint: InterventionEndpoint | None = None  # the intervention endpoint your agent calls
    key: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        _OPEN[self.key] = self

    def ref(self) -> RuntimeRef:
        """A picklable handle on this runtime, for tasks that may run in another process."""
        tools = tuple(sorted(self.toolbox.skills)) if self.toolbox is not None else ()
        return RuntimeRef(self.key, self.settings, self.base_url, tools)

    def base_policy(self) -> Policy:
        """The endpoint's model with the champion adapter (none in generation 0); no skills or tools."""
        return model_policy(self.settings, self.adapter)

    def live_policy(self) -> Policy:
        """The champion: base model and champion adapter, with every promoted skill and tool."""
        if self.library is None:
            return self.base_policy()
        return policy_with(self.base_policy(), self.library.list(status="promoted"))

    def use_tools(self, skills: list[Skill]) -> None:
        """Serve these tool skills to rollouts (the MCP toolbox), replacing the current set."""
        d = self.settings.distill
        self.toolbox = Toolbox(skills, d.tool_timeout_s, d.tool_memory_mb) if skills else None


@dataclass(frozen=True)
class RuntimeRef:
    """What a rollout task needs to find its runtime. In the process that opened it (threads)
    the runtime itself is found by key; a Dask or Ray worker process opens its own from the
    settings, once per process and tool set, and keeps it for the process's life."""

    key: str
    settings: Settings
    base_url: str
    tools: tuple[str, ...] = ()  # the tool skills rollouts may call (candidates' included)

    def resolve(self) -> LoopRuntime:
        rt = _OPEN.get(self.key)
        if rt is not None:
            return rt
        with _worker_lock:
            rt = _WORKER.get((self.key, self.tools))
            if rt is None:
                rt = _WORKER[(self.key, self.tools)] = _worker_runtime(self)
        return rt


_OPEN: weakref.WeakValueDictionary[str, LoopRuntime] = weakref.WeakValueDictionary()
_WORKER: dict[tuple[str, tuple[str, ...]], LoopRuntime] = {}
_worker_lock = threading.Lock()


def _worker_runtime(ref: RuntimeRef) -> LoopRuntime:
    """Suite, store, actor, retriever and toolbox for rollouts in a worker process. Nothing
    here writes shared state but the trajectory store (SQLite in WAL mode takes many writers);
    the champion adapter is already loaded on the endpoint by the process that opened it."""
    s = ref.settings
    prepare_environment(s)
    suite = suite_from(s)
    rt = LoopRuntime(s, suite, open_store(s.trajectories_db), ref.base_url, policy_actor(s, ref.base_url))
    rt.retriever = live_retriever(s)
    if s.agent.entry:  # this process's own endpoint: it records the rollouts this process plays
        rt.agent, rt.endpoint = YourAgent(s.agent), intervention_endpoint(s, ref.base_url).start()
    if ref.tools:
        library = SkillLibrary(s.skills_dir, s.index_dir)
        rt.use_tools([library.get(name) for name in ref.tools])
    return rt


def policy_actor(settings: Settings, url: str) -> Any:
    """The actor graph over the policy's chat model at `url`."""
    m = settings.model
    key = m.api_key.get_secret_value()
    return build_actor(chat_model(url, m.name, key, m.timeout_s, m.max_tokens, tool_call_mode(settings, url)))


def tool_call_mode(settings: Settings, url: str) -> ToolCallMode:
    """How the actor's tool calls travel to `url` (agents/model.py): as configured, or for
    `auto` native on the embedded server and whatever one probe request finds elsewhere."""
    m = settings.model
    if m.tool_calls != "auto":
        return m.tool_calls
    if not m.endpoint:
        return "native"
    mode = probe_tool_calls(url, m.name, m.api_key.get_secret_value(), m.timeout_s)
    if mode == "json":
        log.info("%s returned no tool_calls when one was required: tool calls travel as JSON", url)
    return mode  # type: ignore[return-value]


def live_retriever(settings: Settings) -> SkillRetriever:
    """Top-k retrieval of the live skills for a task (the index every rollout reads)."""
    return SkillRetriever(VectorIndex(settings.index_dir, "skills-live"))


def model_policy(settings: Settings, adapter: AdapterVersion | None) -> Policy:
    """The endpoint's model with `adapter` (None: the base model), no skills or tools."""
    return policy_with(Policy(model=settings.model.name), [adapter] if adapter is not None else [])


def champion_policy(settings: Settings, library: SkillLibrary) -> Policy:
    """The live policy as recorded (champion adapter, promoted skills and tools), no endpoint needed:
    what the CLI and the HTTP API report before and after a decision."""
    return policy_with(
        model_policy(settings, AdapterRegistry(settings).champion()), library.list(status="promoted")
    )


def policy_with(base: Policy, candidates: Sequence[Any]) -> Policy:
    """`base` changed by these candidates, each as its kind says (`ratchet.kinds`: procedures
    and guardrails as prompt skills, tools as tools, rules as rules on the action menu,
    exemplar sets as solved tasks to show, an adapter as the served model), in their order."""
    return apply_all(base, candidates)


@contextmanager
def model_endpoint(settings: Settings, base_url: str | None = None) -> Iterator[str]:
    """Yield a reachable OpenAI-compatible base URL serving `settings.model.name`."""
    url = base_url or settings.model.endpoint
    if url:
        served = check_endpoint(url, settings.model.api_key.get_secret_value())
        if served and settings.model.name not in served:
            raise EndpointError(
                f"{url} does not serve model {settings.model.name!r} (it serves: {', '.join(served[:5])})",
                "set model.name to one of those",
            )
        yield url
        return
    if settings.model.name != BASE_MODEL_NAME:
        raise EndpointError(
            f"the embedded server only serves {BASE_MODEL_NAME!r}, not {settings.model.name!r}",
            "set model.endpoint to a server for that model, or leave model.name at its default",
        )
    with EmbeddedServer(
        settings.models_dir,
        settings.logs_dir,
        port=settings.model.port,
        max_batch=settings.model.max_batch,
        dtype=settings.model.dtype,
        kv_cache_mb=settings.model.kv_cache_mb,
        kv_dtype=settings.model.kv_dtype,
    ) as url:
        yield url


def preflight(settings: Settings, gate: bool = False, splits: Sequence[str] = ("train", "test")) -> None:
    """Fail fast on bad input, before a flow run, a model server or any new state exists.

    Cheapest first: the state files already in the data dir (journal, trajectory DB, skill
    audit log, the champion adapter's files), then the settings (`gate`: the dev split is
    large enough for the A/B gate), the suite and Java, whether the suite has `splits` at the
    sizes set, the endpoint or the port."""
    check_state_files(settings)
    if gate:
        check_dev_size(settings, {"each family": settings.splits.dev})
    suite = suite_from(settings)
    try:
        if settings.trajectories_db.is_file():
            store = open_store(settings.trajectories_db)
            try:
                check_suite_version(store, settings.evolution, suite)
            finally:
                store.close()
        suite.check()
        if settings.explore.search:
            check_search(suite)
        for split in splits:
            try:  # the seeds alone tell whether the split is that large; no need to build tasks
                for subset in suite.subsets:
                    suite.split_seeds(subset, split, getattr(settings.splits, split))
            except ValueError as exc:
                raise ConfigError(f"cannot build the {split} split: {exc}", f"lower splits.{split}") from None
        if settings.agent.entry:
            if settings.explore.search:
                raise ConfigError(
                    "explore.search returns ratchet's actor to stored states; your agent (agent.entry) "
                    "starts every task from its beginning",
                    "set explore.search = 0",
                )
            your_agent(settings, suite)
    finally:
        suite.close()
    if settings.model.endpoint:
        with model_endpoint(settings):
            pass
    else:
        shipped_gguf()  # the model package is installed
        if settings.model.port:
            check_port_free("127.0.0.1", settings.model.port)


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
    from ratchet.flows.journal import Journal

    Journal.load(settings)
    if check_regular_file(settings.trajectories_db, "the trajectory database"):
        store = open_store(settings.trajectories_db)
        try:
            store.check_integrity()
        finally:
            store.close()
    read_audit(settings.skills_dir)
    if may_have_adapters(settings):
        registry = AdapterRegistry(settings)
        champion = registry.champion()
        if champion is not None:
            registry.checked_path(champion)


@contextmanager
def open_runtime(settings: Settings, base_url: str | None = None) -> Iterator[LoopRuntime]:
    """Check everything that can fail on bad input (suite, Java, endpoint) before writing anything."""
    prepare_environment(settings)
    suite = suite_from(settings)
    try:
        suite.check()
        with model_endpoint(settings, base_url) as url, ExitStack() as stack:
            store = open_store(settings.trajectories_db)
            try:
                check_suite_version(store, settings.evolution, suite)
                rt = LoopRuntime(settings, suite, store, url, policy_actor(settings, url))
                rt.teacher = teacher_model(settings, url)
                rt.library = open_library(settings)
                rt.retriever = live_retriever(settings)
                rt.use_tools(rt.library.list(status="promoted", kind="tool"))
                rt.adapter = load_champion_adapter(settings, url)
                rt.model_dtype = served_dtype(url)  # the server's word, not the settings' (a caller's URL)
                if settings.agent.entry:
                    rt.agent = your_agent(settings, suite)
                    rt.endpoint = stack.enter_context(intervention_endpoint(settings, url))
                yield rt
            finally:
                store.close()
    finally:
        suite.close()


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


def intervention_endpoint(settings: Settings, url: str) -> InterventionEndpoint:
    """The endpoint your agent calls, in front of the policy's model at `url`."""
    m = settings.model
    return InterventionEndpoint(url, m.api_key.get_secret_value(), m.timeout_s)


def load_champion_adapter(settings: Settings, url: str) -> AdapterVersion | None:
    """The `champion` alias's adapter, hash-checked and loaded on the endpoint by name (None: base)."""
    registry = AdapterRegistry(settings)
    champion = registry.champion()
    if champion is not None:
        path = registry.checked_path(champion)  # refuses files that do not match the registry's hash
        ensure_adapter(url, champion.served_name, path, settings.model.api_key.get_secret_value())
    return champion


def open_library(settings: Settings) -> SkillLibrary:
    """The skill library; every status change is also logged to the evolution's MLflow run,
    and every decision on a skill or an adapter of this data dir is mirrored into MLflow's
    agent versions and prompts (`agent_versions.follow`, subscribed here once: the runtime,
    the CLI, the HTTP API and the `promote` flow all open the library here)."""
    from ratchet.flows.agent_versions import follow  # it imports this module

    library = SkillLibrary(
        settings.skills_dir, settings.index_dir, settings.distill.merge_similarity, audit_logger(settings)
    )
    follow(settings, library)
    return library


def teacher_model(settings: Settings, policy_url: str) -> BaseChatModel:
    """The teacher's chat model: its own endpoint if configured, else the policy's server."""
    t = settings.teacher
    url = t.endpoint or policy_url
    if t.endpoint:
        check_endpoint(url, t.api_key.get_secret_value())
    key = (t.api_key if t.endpoint else settings.model.api_key).get_secret_value()
    return chat_model(url, t.name or settings.model.name, key, t.timeout_s, t.max_tokens)
