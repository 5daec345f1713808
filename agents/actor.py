"""The actor: the policy acting in one episode, as a LangGraph StateGraph.

    START → model ─(tool call, or a text reply)→ tools ─(not done, budget left)→ model …
              └─(no tool call, budget left)→ model               └─(done / budget spent)→ END

Environment actions are tools (the episode's `tools()` may change every step, e.g. the
valid moves of a text game); active skills enter through the system prompt, active tools
are bound beside the environment's, and the policy's action rules narrow that menu (valid
actions and tools) before the model chooses (`skills/rules.py`; the rules that fired are
recorded on the step). The first two ask for the model's attention; the third does not.
The episode and the step recorder live in the run's context, not in graph state: a node
that raises loses its state update, but its step is still appended to `context.steps` in a
`finally` block.
Errors the model causes (no tool call, an invalid action) are shown to it and the episode
goes on; errors in our code or the environment propagate. A reply without a tool call stays
in the history with a note on what went wrong, so the next ask differs from it even under
greedy decoding (the same prompt would give the same reply). At a step where the episode
offers a text reply (`Episode.offers_text_reply`, from `Episode.text_replies`: never, always,
or to end a turn that has made a call) the model is offered `tool_choice="auto"`, else
"required"; a text reply it takes is the step's action: the episode reads it
(`Episode.reply`) like a tool call, and it ends the turn (`RolloutContext.calls_this_turn`).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Protocol, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.runtime import Runtime

from ratchet.agents.prompts import REPEAT_MIN_CHARS, SYSTEM, repeat_note, task_prompt
from ratchet.diagnosis.attribution import seen_key, state_key
from ratchet.hashing import content_hash
from ratchet.skills.calls import apply_policy, for_task
from ratchet.skills.rules import bind_to_menu, call_text, constrain_tools, menu_entries, normal
from ratchet.suites.base import ActionError, Episode, StepResult
from ratchet.types import (
    NO_TOOL_CALL,
    TOOL_ERROR,
    ModelCall,
    Policy,
    PromptRecord,
    RuleSpec,
    SkillText,
    Step,
    ToolCall,
    Tried,
)

# Search's narrowing of the menu after a branch (`RolloutContext.known`), recorded on the
# steps it changed as a rule of this name would be; it is no rule of any policy.
UNTRIED_ONLY = RuleSpec(name="search-untried", no_repeat=True)


class ToolRunner(Protocol):
    """Executes the policy's active tools (skills.toolbox.Toolbox, over MCP).

    Returns the text result (a function tool) or a plan of environment actions (a macro),
    and raises ActionError when the tool fails; `task` is the current task's text.
    """

    def call(self, name: str, args: dict[str, Any], task: str) -> str | list[ToolCall]: ...


@dataclass(frozen=True)
class ActorSettings:
    max_steps: int
    temperature: float = 0.0
    epsilon: float = 0.0  # explore only: chance of a random valid action instead of the model's
    history_window: int = 10
    seed: int = 0
    max_tokens: int | None = None  # output budget of one model call (None: the chat model's own)
    compact_repeats: bool = False  # a result shown before word for word is shown as a note (build_prompt)


@dataclass
class RolloutContext:
    """Per-run state that is not serializable or must survive a raising node."""

    episode: Episode
    policy: Policy
    settings: ActorSettings
    observation: str
    options: str = ""  # the latest StepResult.options, appended to whatever the model sees last
    tool_runner: ToolRunner | None = None
    skills: tuple[SkillText, ...] | None = None  # the policy's skills chosen for this task; None = all
    exemplars: tuple[SkillText, ...] | None = None  # its exemplars chosen for this task; None = all
    steps: list[Step] = field(default_factory=list)
    outcome: StepResult | None = None
    pending: Step | None = None
    tried: list[Tried] = field(default_factory=list)  # (observation, action) of every played step
    calls_this_turn: int = 0  # calls played since the start or the last text reply the episode took
    macro_actions: int = 0  # environment actions the current step's macro played or tried
    # search: at the first step of the rollout's own, play a valid action not in this set
    # (actions taken from there before, `call_text` form) instead of asking the model
    branch_away: frozenset[str] | None = None
    # search: the actions the task's stored trajectories took at each (progress, state); after
    # the branch, the model is offered at such a state only actions never taken there, while
    # any is left. Measured without it, 75% of a searched rollout's model steps took an action
    # already taken at that state (bench/RESULTS.md, search_gain): the replayed opening again.
    known: Mapping[tuple[float, str], frozenset[str]] = field(default_factory=dict)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.settings.seed)

    @property
    def budget_used(self) -> int:
        """Of `max_steps`: a step costs 1, a macro's step each environment action it played or
        tried. The budget counts the environment's actions, as the random and gold baselines
        do, so a policy with macros is compared with them on the same number of actions."""
        return sum(s.budget for s in self.steps)  # as `Trajectory.budget_used`

    @property
    def budget_left(self) -> bool:
        return self.budget_used < self.settings.max_steps

    def call(self, step: Step | None = None) -> ModelCall:
        """This step's model call with the policy applied (`skills/calls.py`, as the endpoint
        and the gateway apply it): the system prompt with the skills and exemplars chosen for
        the task; the environment's tools of this step and the policy's own, narrowed by its
        rules (and, after a search branch, by `UNTRIED_ONLY`) and bound by its argument
        constraints to what it has read (the task, every observation so far). Which fired, and
        the menu as offered, are recorded on `step`."""
        offered = bind_to_menu([*self.episode.tools(), *self.policy.tools])
        read = (self.episode.task.instruction, *(s.observation for s in self.steps), self.observation)
        call = apply_policy(
            for_task(self.policy, self.skills, self.exemplars),
            ModelCall(
                model=self.policy.model,
                system=SYSTEM,
                tools=tuple(offered),
                observation=self.observation,
                reads=read if self.policy.constraints else (),
                tried=tuple(self.tried),
            ),
        )
        if self.known:  # search's narrowing, after the policy's: no rule of any policy
            tools, novel = constrain_tools(call.tools, [UNTRIED_ONLY], self.observation, self.taken_here())
            call = replace(call, tools=tuple(tools), fired=(*call.fired, *novel))
        if step is not None:
            step.rules, step.menu = list(call.fired), menu_entries(offered)
        return call

    def taken_here(self) -> list[Tried]:
        """The actions taken at the current state and progress, by the stored trajectories
        (`known`) and by this rollout, as `UNTRIED_ONLY` reads them."""
        now = round(sum(s.reward for s in self.steps), 6)
        here = seen_key(join_options(self.observation, self.options))
        taken = set(self.known.get((now, here), frozenset()))
        progress = 0.0
        for step in self.steps:
            if step.tool_call is not None and round(progress, 6) == now and state_key(step) == here:
                taken.add(call_text(step.tool_call))
            progress += step.reward
        return [Tried(normal(self.observation), a) for a in sorted(taken)]

    def prompt_record(self, task: str, first_observation: str) -> PromptRecord:
        call = self.call()
        return PromptRecord(
            system=call.system_text,
            task=task,
            first_observation=first_observation,
            tools=[t.to_openai() for t in call.tools],
            window=self.settings.history_window,
            compact_repeats=self.settings.compact_repeats,
        )


class ActorState(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    task: str  # instruction + first observation, always shown


def build_actor(llm: BaseChatModel) -> Any:
    """Compile the actor graph around a chat model (ChatOpenAI, or a scripted fake in unit tests)."""

    def model(state: ActorState, runtime: Runtime[RolloutContext]) -> dict[str, Any]:
        ctx = runtime.context
        step = Step(index=len(ctx.steps), observation=join_options(ctx.observation, ctx.options))
        started = time.perf_counter()
        try:
            text_ok = ctx.episode.offers_text_reply(ctx.calls_this_turn)  # decided once per step
            call = None
            if ctx.branch_away is not None:
                call, ctx.branch_away = untried_action(ctx, ctx.branch_away), None
                step.source = "search"
            elif ctx.settings.epsilon > 0 and ctx.rng.random() < ctx.settings.epsilon:
                call = ctx.episode.random_action(ctx.rng)
                step.source = "epsilon"
            if call is not None:
                msg = AIMessage(
                    content="",
                    tool_calls=[
                        {
                            "name": call.name,
                            "args": call.args,
                            "id": f"{step.source}_{step.index}",
                            "type": "tool_call",
                        }
                    ],
                )
            else:
                step.source = "model"
                msg = _ask(llm, state, ctx, step, text_ok)
            step.message = str(msg.content or "")
            if not msg.tool_calls:
                if text_ok:  # the reply is the step's action: the episode reads it
                    ctx.pending = step
                    return {"messages": [AIMessage(content=step.message)]}
                step.error = NO_TOOL_CALL
                step.tool_result = no_call_note(msg)
                return {"messages": text_turn(step)}  # kept, so the next ask is not the same one
            first = msg.tool_calls[0]
            step.tool_call = ToolCall(name=first["name"], args=first["args"])
            ctx.pending = step
            # keep one call per turn so every call in history has its tool result; a fresh message
            # id, so a reply that repeats an id never replaces an earlier turn in the history
            return {"messages": [AIMessage(content=msg.content, tool_calls=[first])]}
        except Exception as exc:
            step.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            step.seconds = time.perf_counter() - started
            if ctx.pending is not step:
                ctx.steps.append(step)

    def tools(state: ActorState, runtime: Runtime[RolloutContext]) -> dict[str, Any]:
        ctx = runtime.context
        step, ctx.pending = ctx.pending, None
        assert step is not None
        act(ctx, step)
        if step.tool_call is None:
            return {"messages": [HumanMessage(step.tool_result)]}
        call_id = state["messages"][-1].tool_calls[0]["id"]  # type: ignore[union-attr]
        return {"messages": [ToolMessage(content=step.tool_result, tool_call_id=call_id)]}

    def after_model(state: ActorState, runtime: Runtime[RolloutContext]) -> str:
        if runtime.context.pending is not None:
            return "tools"
        return "model" if runtime.context.budget_left else END

    def after_tools(state: ActorState, runtime: Runtime[RolloutContext]) -> str:
        ctx = runtime.context
        return END if ctx.outcome is not None or not ctx.budget_left else "model"

    graph = StateGraph(ActorState, context_schema=RolloutContext)
    graph.add_node("model", model)
    graph.add_node("tools", tools)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", after_model, ["tools", "model", END])
    graph.add_conditional_edges("tools", after_tools, ["model", END])
    return graph.compile(name="actor")


def act(ctx: RolloutContext, step: Step) -> None:
    """Play `step`'s call (or its text reply) in the episode and record what came back on the
    step and in `ctx`: the result, its cost of the budget, what was tried from where. An
    invalid action is the step's error, shown to the model; any other exception propagates
    (the step is recorded either way)."""
    started = time.perf_counter()
    try:
        if step.tool_call is None:
            result = ctx.episode.reply(step.message)
            ctx.calls_this_turn = 0  # a text reply the episode took ends the turn
        else:
            ctx.macro_actions = 0
            try:
                result = _traced(ctx, step.tool_call)
            finally:
                step.budget = max(1, ctx.macro_actions)
            ctx.tried.append(Tried(normal(ctx.observation), call_text(step.tool_call)))
            ctx.calls_this_turn += 1
        step.tool_result, step.reward = result.observation, result.reward
        ctx.options = result.options
        if result.done:
            ctx.outcome = result
    except ActionError as exc:
        step.error = str(exc)
        step.tool_result = f"Invalid action: {exc}"
    except Exception as exc:
        step.error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        step.seconds += time.perf_counter() - started
        ctx.steps.append(step)
    ctx.observation = step.tool_result


class ReplayDiverged(RuntimeError):
    """A replayed step did not see, or did not get, what the stored trajectory recorded: the
    suite is not deterministic where it said it was (`Suite.replayable`), or the stored
    trajectory is of another suite version."""


def replay_steps(ctx: RolloutContext, stored: list[Step]) -> list[AnyMessage]:
    """Play `stored` (a stored trajectory's first steps) again in `ctx`'s fresh episode, without
    asking the model, and return the history the actor would hold after them. Each replayed
    step must see the observation and get the result the stored one did, else
    `ReplayDiverged` names the step; an episode that ends inside the prefix diverged too
    (a branch point is always before the end)."""
    history: list[AnyMessage] = []
    for old in stored:
        step = Step(
            index=len(ctx.steps),
            observation=join_options(ctx.observation, ctx.options),
            message=old.message,
            tool_call=old.tool_call,
            source="replay",
            menu=old.menu,
        )
        if step.observation != old.observation:
            raise ReplayDiverged(
                f"step {old.index}: the episode showed another observation than the stored one"
            )
        if not old.moves_on:  # a reply without a call changed nothing: it stays in the history only
            step.error, step.tool_result = old.error, old.tool_result
            ctx.steps.append(step)
            history += text_turn(step)
            continue
        act(ctx, step)
        if step.tool_result != old.tool_result or (step.error is None) != (old.error is None):
            raise ReplayDiverged(
                f"step {old.index}: {call_text_of(old)} gave another result than the stored one"
            )
        if ctx.outcome is not None:
            raise ReplayDiverged(f"step {old.index}: the episode ended inside the replayed steps")
        if step.tool_call is None:  # a text reply the episode took
            history += text_turn(step)
        else:
            call_id = f"replay_{step.index}"
            call = {
                "name": step.tool_call.name,
                "args": step.tool_call.args,
                "id": call_id,
                "type": "tool_call",
            }
            history += [
                AIMessage(content=step.message, tool_calls=[call]),
                ToolMessage(content=step.tool_result, tool_call_id=call_id),
            ]
    return history


def call_text_of(step: Step) -> str:
    return call_text(step.tool_call) if step.tool_call is not None else repr(step.message[:40])


def untried_action(ctx: RolloutContext, away: frozenset[str]) -> ToolCall | None:
    """A valid action now that is not in `away`, drawn with the rollout's own generator; None
    where the episode lists no valid actions or every one was tried (the model then chooses)."""
    fresh = [c for c in ctx.episode.valid_actions() if call_text(c) not in away]
    return ctx.rng.choice(fresh) if fresh else None


def _ask(llm: BaseChatModel, state: ActorState, ctx: RolloutContext, step: Step, text_ok: bool) -> AIMessage:
    """One model call: system prompt with skills, the task, the last few steps; a tool call is
    required unless the episode offers a text reply at this step (`text_ok`: "auto")."""
    call = ctx.call(step)
    prompt = build_prompt(
        call.system_text,
        state["task"],
        state["messages"],
        ctx.settings.history_window,
        ctx.options,
        ctx.settings.compact_repeats,
    )
    seed = int(content_hash([ctx.settings.seed, step.index], length=8), 16) % (2**31)
    tools = [t.to_openai() for t in call.tools]
    bound = llm.bind_tools(tools, tool_choice="auto" if text_ok else "required") if tools else llm
    options: dict[str, Any] = {"temperature": ctx.settings.temperature, "seed": seed}
    if ctx.settings.max_tokens is not None:
        options["max_tokens"] = ctx.settings.max_tokens
    # the policy's adapter is addressed by name as the request's model (vLLM's multi-LoRA convention)
    msg = bound.invoke(prompt, model=call.model, **options)
    usage = getattr(msg, "usage_metadata", None) or {}
    step.prompt_tokens = int(usage.get("input_tokens", 0))
    step.completion_tokens = int(usage.get("output_tokens", 0))
    return msg  # type: ignore[return-value]


def build_prompt(
    system: str,
    task: str,
    history: list[AnyMessage],
    window: int,
    options: str,
    compact_repeats: bool = False,
) -> list[AnyMessage]:
    """The messages of one model call. Training replays stored trajectories through this same
    function (training/examples.py), so the fine-tuning data is exactly what the actor sent."""
    shown = history[2 * history_start(len(history) // 2, window) :]
    if compact_repeats:
        shown = compact(task, shown)
    prompt: list[AnyMessage] = [SystemMessage(system), HumanMessage(task), *shown]
    if options:  # current options go with the latest message only, never into history
        prompt[-1] = prompt[-1].model_copy(update={"content": join_options(str(prompt[-1].content), options)})
    return prompt


def compact(task: str, shown: list[AnyMessage]) -> list[AnyMessage]:
    """Past tool results the model can already read word for word, in the task or earlier in
    the window, shortened to `repeat_note`: a text game shows the same room description after
    every `look around` and every return to a room, ~160 tokens each time, and every later
    step attends to (and the server copies the keys and values of) every copy.

    The latest result is always shown in full, since it is what the model acts on; like the
    valid actions appended to it, it is shortened when the next step makes it history, and
    the note starts with the same first sentence, so the server's prefix cache still holds
    everything before it. Any other message renders the same at every step until the window
    trims (then a result whose first copy was dropped is shown in full again; the trim
    re-prefills from there anyway).

    Off by default (`Settings.compact_repeats`): on coin the shipped model lost 4 of 30 test
    tasks by it, with the latest result shortened or not (bench/results/compact_obs.json)."""
    seen: set[str] = set()
    out: list[AnyMessage] = []
    for i, m in enumerate(shown):
        text = str(m.content)
        if isinstance(m, ToolMessage) and len(text) >= REPEAT_MIN_CHARS:
            if (text in seen or text in task) and i < len(shown) - 1:
                m = m.model_copy(update={"content": repeat_note(text)})
            seen.add(text)
        out.append(m)
    return out


def history_start(n_steps: int, window: int) -> int:
    """First past step shown: between window/2 and `window` recent steps, trimmed in blocks.

    Dropping old steps one at a time would change the start of the prompt every step and
    defeat the model server's prefix cache; dropping them half a window at a time keeps the
    prompt a pure extension of the previous one for window/2 steps in a row.
    """
    if n_steps <= window:
        return 0
    block = max(1, window // 2)
    return ((n_steps - window - 1) // block + 1) * block


def _traced(ctx: RolloutContext, call: ToolCall) -> StepResult:
    """`_execute`, as a TOOL span of its own when the rollout is traced (MLflow autolog has the
    `tools` node's span active: `flows/traces.py`). mlflow is looked up, not imported: if it
    is not loaded, nothing is tracing."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.get_current_active_span() is None:
        return _execute(ctx, call)
    with mlflow.start_span(name=call.name, span_type="TOOL") as span:
        span.set_inputs(call.args)
        result = _execute(ctx, call)
        span.set_outputs({"observation": result.observation, "reward": result.reward, "done": result.done})
        return result


def _execute(ctx: RolloutContext, call: ToolCall) -> StepResult:
    if call.name in {t.name for t in ctx.episode.tools()}:
        return ctx.episode.step(call)
    if call.name in {t.name for t in ctx.policy.tools}:
        if ctx.tool_runner is None:
            raise RuntimeError(f"policy tool {call.name!r} is active but no tool runner was given")
        try:
            out = ctx.tool_runner.call(call.name, call.args, ctx.episode.task.instruction)
        except ActionError as exc:
            raise ActionError(f"{TOOL_ERROR}: {call.name}: {exc}") from None
        return _play(ctx, call.name, out) if isinstance(out, list) else StepResult(observation=out)
    raise ActionError(f"unknown tool {call.name!r}")


def _play(ctx: RolloutContext, name: str, plan: list[ToolCall]) -> StepResult:
    """Play a macro's actions as one step; stop early when the episode ends, an action is
    refused (a refused first action changes nothing and is the tool's error) or the step
    budget runs out: each action tried costs one of it (`RolloutContext.budget_used`).

    Where the episode lists its valid actions, a later action not on the list is not tried:
    the macro stops there for free, as an agent reading the menu would (`move {a}` then
    `take coin` in a room without a coin costs one action, not two). The random and gold
    baselines never play an unlisted action either."""
    env_tools = {t.name for t in ctx.episode.tools()}
    lines: list[str] = []
    result = StepResult(observation="")
    reward = 0.0
    room = ctx.settings.max_steps - ctx.budget_used  # this step's own 1 included: room >= 1
    for i, action in enumerate(plan):
        shown = ", ".join(str(v) for v in action.args.values())
        if i >= room:
            lines.append(f"(macro stopped: the step budget ran out before {shown!r})")
            break
        if i > 0 and (listed := {call_text(c) for c in ctx.episode.valid_actions()}):
            if call_text(action) not in listed:
                lines.append(f"(macro stopped: {shown!r} is not a valid action here)")
                break
        ctx.macro_actions += 1
        try:
            if action.name not in env_tools:
                raise ActionError(f"unknown environment tool {action.name!r}")
            result = ctx.episode.step(action)
        except ActionError as exc:
            if i == 0:
                raise ActionError(f"{TOOL_ERROR}: {name}: {shown!r} was refused: {exc}") from None
            lines.append(f"(macro stopped: {shown!r} was refused)")
            break
        reward += result.reward
        lines.append(f"> {shown}\n{result.observation}")
        if result.done:
            break
    result.observation, result.reward = "\n".join(lines), reward
    return result


def no_call_note(msg: AIMessage) -> str:
    """What the model is told after a reply that called no tool: what went wrong, what to do."""
    meta = msg.response_metadata or {}
    cut = meta.get("finish_reason") == "length"
    why = "was cut off at the output limit before it made a tool call" if cut else "called no tool"
    return f"Your last reply {why}. Call exactly one of the tools, with short arguments."


def text_turn(step: Step) -> list[AnyMessage]:
    """The messages a step without a tool call leaves in the history: the reply, then what
    came back (the episode's answer to a text reply, or the note on a missing call). A step
    stored before such turns were kept has no `tool_result` and left nothing."""
    if step.tool_call is not None or (not step.moves_on and not step.tool_result):
        return []
    return [AIMessage(content=step.message), HumanMessage(step.tool_result)]


def join_options(text: str, options: str) -> str:
    """What the model sees: an observation with the current options (e.g. valid actions) appended."""
    return f"{text}\n{options}" if options else text


def initial_state(instruction: str, observation: str) -> ActorState:
    return {"messages": [], "task": task_prompt(instruction, observation)}
