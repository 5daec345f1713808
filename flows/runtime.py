"""What every flow needs open while it runs: suite, trajectory store, model endpoint, actor.

The endpoint is either the configured one (checked once, with a clear error if it is
unreachable) or the embedded server, started here and stopped when the `with` ends.
"""

from __future__ import annotations

import logging
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
from ratchet.endpoint.entry import YourAgent
from ratchet.endpoint.serve import InterventionEndpoint
from ratchet.errors import EndpointError
from ratchet.flows.preflight import (  # noqa: F401 - check_* and preflight are also imported from here
    check_dev_size,
    check_model_endpoint,
    check_search,
    check_state_files,
    check_suite_version,
    preflight,
    your_agent,
)
from ratchet.flows.tracking import audit_logger
from ratchet.kinds import apply_all
from ratchet.memory.retrieval import SkillRetriever
from ratchet.memory.trajectory_store import TrajectoryStore, open_store
from ratchet.memory.vector_index import VectorIndex
from ratchet.runtime_env import prepare_environment
from ratchet.server.launcher import (
    EmbeddedServer,
    check_endpoint,
    ensure_adapter,
    probe_tool_calls,
    served_dtype,
)
from ratchet.server.weights import BASE_MODEL_NAME
from ratchet.skills.format import Skill
from ratchet.skills.library import SkillLibrary
from ratchet.skills.toolbox import Toolbox
from ratchet.suites import Suite, suite_from
from ratchet.training.registry import AdapterRegistry, AdapterVersion
from ratchet.types import Policy

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
    if s.agent.name:  # this process's own endpoint: it records the rollouts this process plays
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
        check_model_endpoint(settings, url)
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
                if settings.agent.name:
                    rt.agent = your_agent(settings, suite)
                    rt.endpoint = stack.enter_context(intervention_endpoint(settings, url))
                yield rt
            finally:
                store.close()
    finally:
        suite.close()


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
