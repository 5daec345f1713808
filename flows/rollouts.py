"""Rollouts as Prefect tasks: mapped with a concurrency limit, retried on transient model errors,
and skipped when a finished trajectory for the same slot is already stored (resumable)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from ratchet import faults
from ratchet.agents.actor import ActorSettings
from ratchet.agents.baselines import Baselines, VersusRandom
from ratchet.agents.model import is_transient
from ratchet.agents.rollout import RolloutSlot, run_rollout
from ratchet.config import Settings
from ratchet.endpoint.agent import run_agent_rollout
from ratchet.endpoint.recording import Arm
from ratchet.flows import agent_versions, display, traces, tracking
from ratchet.flows.progress import report
from ratchet.flows.runtime import LoopRuntime, RuntimeRef
from ratchet.hashing import content_hash
from ratchet.shutdown import stopping
from ratchet.stats import wilson_interval
from ratchet.types import Policy, PromptRecord, Split, Trajectory

if TYPE_CHECKING:
    from rich.console import Console


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            state.result(raise_on_failure=True)
        except BaseException as e:  # noqa: BLE001 - we only classify it
            exc = e
    return exc is not None and is_transient(exc) and not stopping()


# Every task that calls a model: retried only on transient endpoint errors, never cached
# (a rerun is resumed from the stores, not from Prefect's result cache).
MODEL_CALL: dict[str, Any] = dict(
    retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_transient, cache_policy=NO_CACHE
)


@task(name="rollout", task_run_name="rollout {slot.task.id} #{slot.rollout}", **MODEL_CALL)
def rollout_task(
    ref: RuntimeRef,
    slot: RolloutSlot,
    policy: Policy,
    settings: ActorSettings,
    trace: traces.TraceTarget | None = None,
) -> str:
    """Play one slot and store its trajectory (an upsert: a retried or rerun slot replaces its row);
    `trace`: the slot was sampled for an MLflow trace (`flows/traces.py`), and where it goes.

    Takes a picklable `RuntimeRef`, not the runtime: with a Dask or Ray task runner it runs in
    another process.

    Once the process is stopping (Ctrl-C), a slot not begun is left unplayed and one in flight
    ends without a word: the runtime's store and model server are closing under it, and the
    rerun plays both slots (returns "" for them)."""
    if stopping():
        return ""
    try:
        return _play_and_store(ref, slot, policy, settings, trace)
    except Exception:
        if stopping():
            return ""
        raise


def _play_and_store(
    ref: RuntimeRef,
    slot: RolloutSlot,
    policy: Policy,
    settings: ActorSettings,
    trace: traces.TraceTarget | None,
) -> str:
    rt = ref.resolve()
    skills = exemplars = None
    if rt.retriever is not None:  # the top-k promoted skills and the nearest solved tasks
        skills, exemplars = rt.retriever.for_task(slot.task.instruction, policy, rt.settings.skills)
    with traces.rollout_trace(trace, slot) as finish:
        if rt.agent is not None and rt.endpoint is not None:  # your agent, behind the endpoint
            arm = Arm(
                policy,
                skills,
                exemplars,
                temperature=settings.temperature,
                seed=settings.seed,
                max_steps=settings.max_steps,
                max_tokens=settings.max_tokens,
                toolbox=rt.toolbox,
                task=slot.task.instruction,
            )
            traj = run_agent_rollout(rt.agent, rt.suite, slot, rt.endpoint, arm)
        else:
            traj = run_rollout(
                rt.actor,
                rt.suite,
                slot,
                policy,
                settings,
                tool_runner=rt.toolbox,
                skills=skills,
                exemplars=exemplars,
            )
        finish(traj)
    rt.store.put(traj)
    faults.point("rollout.stored")
    return traj.id


@dataclass
class RolloutReport:
    """What a set of rollouts achieved; metrics are over stored finished trajectories."""

    split: str
    n: int
    successes: int
    errors: int
    skipped: int
    mean_steps: float
    prompt_tokens: int
    completion_tokens: int
    rollout_seconds: float
    by_task: dict[str, float] = field(default_factory=dict)

    @property
    def success_rate(self) -> float:
        return self.successes / self.n if self.n else 0.0

    @property
    def ci95(self) -> tuple[float, float]:
        return wilson_interval(self.successes, self.n)

    def metrics(self, prefix: str) -> dict[str, float]:
        lo, hi = self.ci95
        return {
            f"{prefix}_success": self.success_rate,
            f"{prefix}_success_ci_low": lo,
            f"{prefix}_success_ci_high": hi,
            f"{prefix}_rollouts": float(self.n),
            f"{prefix}_errors": float(self.errors),
            f"{prefix}_mean_steps": self.mean_steps,
            f"{prefix}_prompt_tokens": float(self.prompt_tokens),
            f"{prefix}_completion_tokens": float(self.completion_tokens),
            f"{prefix}_rollout_seconds": self.rollout_seconds,
        }


def run_slots(
    rt: LoopRuntime,
    slots: Sequence[RolloutSlot],
    policy: Policy,
    settings_for: Callable[[RolloutSlot], ActorSettings],
    stage: str,
    trace: traces.TraceTarget | None = None,
) -> RolloutReport:
    """Run every slot not already finished in the store by this same policy; report over all slots.

    A stored rollout of another policy version (the model or skills changed between two runs
    of the same generation) is played again and replaced, never mixed into the metrics.
    """
    if not slots:
        return summarize([], split="")
    skipped = play(rt, [(s, policy) for s in slots], settings_for, stage, trace)
    trajectories = [t for s in slots if (t := rt.store.get(s.id)) is not None]
    rep = summarize(trajectories, split=slots[0].task.split, skipped=skipped)
    rep.errors += len(slots) - len(trajectories)  # retries exhausted: nothing stored for the slot
    return rep


def play(
    rt: LoopRuntime,
    items: Sequence[tuple[RolloutSlot, Policy]],
    settings_for: Callable[[RolloutSlot], ActorSettings],
    stage: str,
    trace: traces.TraceTarget | None = None,
) -> int:
    """Play each slot with its policy (several policies at once: the arms of A/B tests), skipping
    slots already finished by that same policy version on this suite version; returns how
    many were skipped. With `trace`, the slots it samples are traced to MLflow."""
    policies = {p.version: p for _, p in items}
    if rt.retriever is not None:
        for p in policies.values():
            if p.skills or p.exemplars:
                rt.retriever.sync((*p.skills, *p.exemplars))
    done: set[str] = set()
    for version in policies:
        done |= rt.store.finished_ids(
            [s.id for s, p in items if p.version == version],
            policy_version=version,
            suite_version=rt.suite.version,
        )
    todo = [(s, p) for s, p in items if s.id not in done]
    total, finished = len(items), len(items) - len(todo)
    report(stage, finished, total)
    ref = rt.ref()
    sampled = {s.id for s, _ in todo if trace is not None and trace.wants(s)}
    futures = [
        rollout_task.submit(ref, s, p, settings_for(s), trace if s.id in sampled else None) for s, p in todo
    ]
    for _ in as_completed(futures) if futures else ():
        finished += 1
        report(stage, finished, total)
    if sampled:
        traces.flush()
    return len(items) - len(todo)


def summarize(trajectories: Sequence[Trajectory], split: str, skipped: int = 0) -> RolloutReport:
    agent = [t for t in trajectories if t.kind == "agent"]
    finished = [t for t in agent if t.status == "finished"]
    by_task: dict[str, list[bool]] = defaultdict(list)
    for t in agent:  # an errored rollout counts as a failure: errors must never raise a success rate
        by_task[t.task_id].append(t.success and t.status == "finished")
    n = len(finished)
    return RolloutReport(
        split=split,
        n=len(agent),
        successes=sum(t.success for t in finished),
        errors=sum(t.status == "error" for t in agent),
        skipped=skipped,
        mean_steps=sum(t.n_steps for t in finished) / n if n else 0.0,
        prompt_tokens=sum(t.prompt_tokens for t in finished),
        completion_tokens=sum(t.completion_tokens for t in finished),
        rollout_seconds=sum(t.seconds for t in finished),
        by_task={k: sum(v) / len(v) for k, v in sorted(by_task.items())},
    )


@dataclass
class StageResult:
    stage: str
    report: RolloutReport
    wall_seconds: float
    policy_version: str
    baselines: Baselines | None = None  # evaluate: random and gold levels on the same tasks
    vs_random: VersusRandom | None = None  # evaluate: the policy against random, task by task
    model_id: str = ""  # the policy's agent version in MLflow ('' outside a tracked run)
    slot_ids: list[str] = field(default_factory=list, repr=False)  # the trajectory ids it played, in order
    searched: tuple[int, int] | None = None  # explore with search: searched rollouts, their successes

    def summary(self) -> dict[str, Any]:
        """The journal's record of the stage (`ratchet.flows.stage.StageOutcome`)."""
        r = self.report
        return {
            "n": r.n,
            "successes": r.successes,
            "success_rate": r.success_rate,
            "ci95": list(r.ci95),
            "errors": r.errors,
            "tokens": r.prompt_tokens + r.completion_tokens,
            "policy_version": self.policy_version,
            **({"baselines": self.baselines.summary()} if self.baselines else {}),
            **({"vs_random": asdict(self.vs_random)} if self.vs_random else {}),
            **({"searched": list(self.searched)} if self.searched is not None else {}),
            # per task, so each generation is paired with generation 0 on the same tasks (`flows/journal.py`)
            **({"by_task": dict(r.by_task)} if self.stage == "evaluate" else {}),
        }

    def render(self, console: Console, settings: Settings, run_id: str | None = None) -> None:
        type(self).render_all([self], console, settings, run_id=run_id)

    @classmethod
    def render_all(
        cls, results: Sequence[StageResult], console: Console, settings: Settings, run_id: str | None = None
    ) -> None:
        """Explore and evaluate side by side: one table, then the baselines and the run's footer."""
        display.rollouts(console, settings, results, run_id)


def derive_seed(*parts: object) -> int:
    return int(content_hash(list(parts), length=8), 16) % (2**31)


def actor_settings(
    s: Settings, slot: RolloutSlot, temperature: float, epsilon: float, seed: int
) -> ActorSettings:
    """How one slot is played: the stage's sampling, the suite's (or the settings') step budget,
    and the output budget of the task (its suite's, `Suite.new_task`; None: `model.max_tokens`)."""
    return ActorSettings(
        max_steps=s.max_steps or slot.task.max_steps,
        temperature=temperature,
        epsilon=epsilon,
        history_window=s.history_window,
        compact_repeats=s.compact_repeats,
        seed=seed,
        max_tokens=slot.task.max_tokens,
    )


def run_split(
    rt: LoopRuntime,
    stage: str,
    split: Split,
    generation: int,
    policy: Policy,
    rollouts_per_task: int,
    settings_for: Callable[[RolloutSlot], ActorSettings],
    params: dict[str, Any],
) -> StageResult:
    """`rollouts_per_task` rollouts of every task of `split` (explore and evaluate are this,
    with their own sampling), then metrics, `params` and a sample of trajectories to MLflow."""
    s = rt.settings
    tasks = rt.suite.tasks(split, getattr(s.splits, split))
    slots = [RolloutSlot(s.evolution, generation, t, r) for t in tasks for r in range(rollouts_per_task)]
    run = mlflow.active_run()
    model_id, trace = "", None
    if run is not None:  # the policy's agent version, which its traces and evaluations attach to
        model_id = agent_versions.sync(s, rt.library, policy, run.info.run_id, generation, by=stage)
        trace = traces.target(s, stage, generation, policy.version, run.info.run_id, model_id)
    started = time.perf_counter()
    report = run_slots(rt, slots, policy, settings_for, stage, trace)
    wall, ids = time.perf_counter() - started, [sl.id for sl in slots]
    if model_id and rt.agent is not None:  # the agent version shows what your agent sent
        sent = first_sent(rt, ids)
        if sent is not None:
            agent_versions.record_sent(s, model_id, sent)
    result = StageResult(stage, report, wall, policy.version, model_id=model_id, slot_ids=ids)
    if run is not None:
        _log_split(rt, result, split, slots, params)
    return result


def first_sent(rt: LoopRuntime, ids: Sequence[str]) -> PromptRecord | None:
    """The prompt record of the first of these rollouts in which your agent called the model."""
    for i in ids:
        t = rt.store.get(i)
        if t is not None and t.prompt is not None and t.prompt.sent_system is not None:
            return t.prompt
    return None


def _log_split(
    rt: LoopRuntime, result: StageResult, split: Split, slots: list[RolloutSlot], params: dict[str, Any]
) -> None:
    s = rt.settings
    tracking.log_params(
        {
            "policy_version": result.policy_version,
            "model": s.model.name,
            "endpoint": s.model.endpoint or "embedded",
            # the number format the server says it runs in (`/health`; `server.precision`)
            "model_dtype": rt.model_dtype or "endpoint's own",
            "suite": s.suite,
            "experts_used": s.explore.experts,
            f"{result.stage}_tasks": len({sl.task.id for sl in slots}),
            **params,
        }
    )
    mlflow.log_metrics(result.report.metrics(split) | {f"{result.stage}_wall_seconds": result.wall_seconds})
    trajectories = [t for sl in slots if (t := rt.store.get(sl.id)) is not None]
    tracking.log_success_plot(
        result.report.by_task,
        result.stage,
        f"{result.stage}: success by task ({split}, policy {result.policy_version})",
    )
    tracking.log_trajectory_sample(trajectories, result.stage)
    tracking.log_summary(
        {"split": split, **result.report.__dict__, "wall_seconds": result.wall_seconds}, result.stage
    )
