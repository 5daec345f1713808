"""One typed configuration: TOML file < environment (RATCHET_*) < CLI flags.

The file is `ratchet.toml` in the working directory, or the path in `RATCHET_CONFIG`
(the CLI's `--config` sets that). Nested fields use `__` in environment variables,
e.g. `RATCHET_MODEL__ENDPOINT=http://127.0.0.1:8000/v1`.
All state (trajectories, MLflow, Prefect, model cache, logs) lives under `data_dir`.

Strict on purpose, since a setting that is silently ignored or accepted out of range only fails
hours later: every number has finite bounds, a config path that names no regular file is an
error, and so is a `RATCHET_*` variable that nothing reads (a misspelt setting).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shlex
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from ratchet.errors import ConfigError

CONFIG_ENV = "RATCHET_CONFIG"
ENV_PREFIX = "RATCHET_"
# RATCHET_* variables that are not settings, and who reads them: anything else under the
# prefix is reported as a misspelt setting.
OTHER_VARIABLES = {
    CONFIG_ENV: "the settings file",
    "RATCHET_FAULT": "fault points for crash tests (ratchet/faults.py)",
    "RATCHET_HOME": "the project directory scheduled deployments run in (deployments/prefect.yaml)",
    "RATCHET_SERVER_THREADS": "the embedded model server's threads",
    "RATCHET_CHROMIUM": "the browser the dashboard's browser test drives",
    # what ratchet gives an agent run as a command (endpoint/process.py); an agent that is
    # itself a ratchet command, or a shell that exported them to try one, sets them here too
    "RATCHET_MCP_URL": "the MCP URL of the rollout's distilled tools, for an agent run as a command",
    "RATCHET_MAX_STEPS": "the rollout's step budget, for an agent run as a command",
}
TEST_VARIABLES = "RATCHET_TEST_"  # the test suite's own (models dir, planted secrets)

# Upper bounds where no real run comes near and past which something below breaks: a socket
# timeout, an rlimit or an SQLite INTEGER overflows, or a loop never ends.
DAY_S = 86_400.0
# A model request's time includes its wait in the server's queue behind up to a batch of other
# rollouts' prompts. On a 2-core machine shared with another job (a LoRA fine-tune, a second
# run), a cold batch of 8 mapreader prompts took over 120 s, the old default, and every rollout
# in flight failed and was replayed from its start, adding load to the slow machine. 600 s is
# OpenAI's own client default; a server that dies answers at once (connection refused), and
# one whose engine fails answers with that error, so the timeout only has to catch a hang.
REQUEST_TIMEOUT_S = 600.0
INT64_MAX = 2**63 - 1
MANY = 100_000  # gate tasks, candidates, failures: more than any run uses
# split sizes: past what any suite offers, so the suite's own check says how many it has
# (reasoning-gym: 10**6 per split)
SPLIT_MAX = 10_000_000


def sqlite_url(path: Path, driver: str = "sqlite") -> str:
    """An SQLAlchemy URL for the SQLite file at `path`, percent-encoded: SQLAlchemy cuts a URL
    at '?' and decodes '%xx', so a raw path with those would name another file."""
    return f"{driver}:///{quote(str(path), safe='/')}"


class Section(BaseModel):
    """A `[table]` of the settings: an unknown key (a typo like `endpont`) is an error, not ignored,
    and so is `inf` or `nan` in a number (a timeout of `inf` fails every call it reaches)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


DEFAULT_CONFIG_FILE = "ratchet.toml"


class ModelSettings(Section):
    endpoint: str = Field(
        default="",
        description="OpenAI-compatible base URL (…/v1). Empty: ratchet starts its embedded server.",
    )
    name: str = Field(default="smollm2-135m-instruct", description="model name sent in requests")
    api_key: SecretStr = Field(
        default=SecretStr("not-needed"), description="API key for the endpoint (never logged or stored)"
    )
    timeout_s: float = Field(
        default=REQUEST_TIMEOUT_S, gt=0, le=DAY_S, description="per-request timeout, queueing included"
    )
    max_tokens: int = Field(default=96, gt=0, le=1_000_000, description="completion budget per step")
    port: int = Field(default=0, ge=0, le=65535, description="embedded server port (0 = any free)")
    max_batch: int = Field(default=8, ge=1, le=1024, description="embedded server: max sequences per batch")
    dtype: Literal["float32", "auto", "bfloat16"] = Field(
        default="auto",
        description="embedded server: the model's number format; 'auto' is bfloat16 on CPUs with native bf16 "
        "units (avx512_bf16, amx_bf16: evaluation ~1.6x faster, about one greedy token in 28 changes) and "
        "float32 elsewhere; 'float32' everywhere gives the same greedy runs on machines of one ISA",
    )
    kv_cache_mb: int = Field(
        default=384,
        ge=0,
        le=1_048_576,
        description="embedded server: memory for keys and values, the running requests' and the prefix "
        "cache's, in MiB; more only while running requests alone need it (0: no prefix caching)",
    )
    kv_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto",
        description="embedded server: the number format keys and values are stored in; 'auto' is float16 "
        "under a float32 model (half the memory a token, each rounded once) and the model's own otherwise",
    )
    tool_calls: Literal["auto", "native", "json"] = Field(
        default="auto",
        description="how the actor's tool calls travel: 'native' OpenAI tools, 'json' tools rendered "
        "into the prompt and the reply constrained by a JSON schema (servers whose chat template has "
        "no tools, e.g. llama.cpp's llama-server), 'auto' asks the endpoint once",
    )

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https:// (or be empty for the embedded server)")
        return v


class ExploreSettings(Section):
    rollouts_per_task: int = Field(default=2, ge=1, le=1000, description="k rollouts per train task")
    temperature: float = Field(default=0.8, gt=0, le=2, description="sampling temperature (> 0)")
    epsilon: float = Field(
        default=0.1, ge=0, le=1, description="chance to take a random valid action instead (explore only)"
    )
    experts: bool = Field(
        default=True,
        description="also store the suite's reference solution per train task (kind 'expert': "
        "used to diagnose and distill, never counted as the agent's success)",
    )
    search: int = Field(
        default=0,
        ge=0,
        le=100_000,
        description="model calls per unsolved train task for search from stored states after the "
        "sampled rollouts (agents/search.py; the suite must declare replay); 0 = off",
    )


class EvaluateSettings(Section):
    temperature: float = Field(default=0.0, ge=0, le=2, description="0 = greedy")
    rollouts_per_task: int = Field(default=1, ge=1, le=1000)
    baseline_seeds: int = Field(
        default=5,
        ge=0,
        le=1000,
        description="episodes per test task of the random valid-action policy, reported beside every "
        "test success with the gold path (no model: seconds); 0 = neither",
    )


class TeacherSettings(Section):
    """The model that judges failures and writes skills; separate from the policy so a
    stronger one can be plugged in. Empty endpoint/name = the policy's (the embedded model)."""

    endpoint: str = Field(default="", description="OpenAI-compatible base URL; empty = the policy's")
    name: str = Field(default="", description="model name; empty = the policy's")
    api_key: SecretStr = Field(default=SecretStr("not-needed"), description="bearer token, if any")
    timeout_s: float = Field(default=REQUEST_TIMEOUT_S, gt=0, le=DAY_S)
    max_tokens: int = Field(
        default=384, gt=0, le=1_000_000, description="completion budget per answer (JSON)"
    )


class DiagnoseSettings(Section):
    judge: bool = Field(default=True, description="ask the teacher for each failure's cause in words")
    # A guardrail's writer reads at most 5 causes of its cluster (agents/distiller.py), and
    # the embedded judge's answers are mostly discarded (65 of 82 in the headline's first
    # generation, where judging every failure took 2.3 of its 20 min): past a few per task
    # the judge adds time, not evidence. The failures it skips keep their mode, step and
    # attribution, which is what clusters and the rules are built on.
    judge_max: int = Field(
        default=24,
        ge=0,
        le=MANY,
        description="failures the judge reads per generation and family, one of each task in "
        "turn (0: every failure)",
    )
    cluster_similarity: float = Field(
        default=0.8, gt=0, le=1, description="cosine similarity for two diagnoses to share a cluster"
    )
    min_cluster: int = Field(
        default=3, ge=1, le=MANY, description="members a cluster needs to yield a guardrail"
    )


class DistillSettings(Section):
    teacher: bool = Field(default=True, description="let the teacher phrase skills and write function tools")
    min_tasks: int = Field(
        default=2,
        ge=1,
        le=MANY,
        description="tasks an action pattern, or a guardrail's failure cluster, must span",
    )
    patterns: int = Field(default=4, ge=1, le=1000, description="patterns per family shown to the distiller")
    tools: int = Field(default=2, ge=0, le=1000, description="macro tool candidates per family")
    rules: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="action rule candidates per family (mined, no teacher: skills/rule_mining.py)",
    )
    exemplars: int = Field(
        default=8,
        ge=0,
        le=1000,
        description="solved train tasks an exemplar candidate holds per family; 0 = none",
    )
    constraints: bool = Field(
        default=True,
        description="argument constraints for tools without a menu, mined from the successful calls "
        "of every generation so far (no teacher: skills/constraints.py)",
    )
    teacher_rules: bool = Field(
        default=True,
        description="a configured teacher (teacher.endpoint or teacher.name set) proposes one rule per "
        "family, under the miner's checks; the policy's own model never does",
    )
    merge_similarity: float = Field(
        default=0.92, gt=0, le=1, description="near-duplicates of an existing skill are merged into it"
    )
    tool_timeout_s: float = Field(
        default=5.0, gt=0, le=3600, description="sandbox wall-clock limit per tool call"
    )
    tool_memory_mb: int = Field(
        default=256, ge=32, le=65_536, description="sandbox memory limit per tool call"
    )


class GateSettings(Section):
    """The A/B gate, declared once: `skills/intervention.py` decides with exactly these.

    A candidate runs against the champion on the same dev tasks and seeds; every
    `look_every` tasks the gate looks at the paired outcomes (exact one-sided McNemar test,
    alpha spent over the looks) and admits, rejects (futile, or too many regressions) or
    goes on, up to `max_tasks`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alpha: float = Field(default=0.05, gt=0, lt=1, description="one-sided level: chance to admit a no-gain")
    max_tasks: int = Field(
        default=64,
        ge=1,
        le=MANY,
        description="dev tasks a candidate may use (capped by the dev split); the last look",
    )
    look_every: int = Field(
        default=8, ge=1, le=MANY, description="dev tasks per look (both arms), then the gate"
    )
    spending_rho: float = Field(
        default=1.0,
        gt=0,
        le=10,
        description="alpha spent by task t: alpha*(t/max_tasks)**rho; > 1 saves it for later",
    )
    max_regressions: float = Field(
        default=0.1, ge=0, le=1, description="admit only with regressions <= this share of tasks seen"
    )
    # 0.1, not 0.05: with a 32-task budget a candidate that changes nothing (most distilled
    # ones) stops after 8 tasks instead of 16, for ~8 points less power on a +0.15-per-task gain
    # (bench/gate_efficiency.py --max-tasks 32 --futility 0.05 0.1; bench/RESULTS.md)
    futility: float = Field(
        default=0.1, ge=0, lt=1, description="stop early when success at the end is this unlikely; 0 = off"
    )

    def regression_cap(self, tasks: int) -> int:
        return math.floor(self.max_regressions * tasks + 1e-9)

    def alpha_spent(self, tasks: int) -> float:
        return self.alpha * min(1.0, tasks / self.max_tasks) ** self.spending_rho

    def look_ends(self) -> list[int]:
        """Task counts at which the gate decides: every `look_every`, and `max_tasks`."""
        return [*range(self.look_every, self.max_tasks, self.look_every), self.max_tasks]


class VerifySettings(GateSettings):
    """`verify`: the gate's settings, and who promotes what it verifies. Mutable like every
    section; the gate itself gets a frozen `GateSettings` (`flows.verify.gate_config`)."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    promotion: Literal["auto", "manual"] = Field(
        default="auto", description="auto: verified candidates go live at once; manual: a person promotes"
    )
    # a gate over a strong champion needs tasks it fails: at 89%, 32 dev tasks hold ~3.5, under
    # the 5 repairs a gain needs (skills/intervention.py: grown_budget; bench/dev_budget.py)
    min_failures: int = Field(
        default=8,
        ge=0,
        le=MANY,
        description="champion failures a gate should hold: where its known dev success rate leaves "
        "fewer in splits.dev, the gate's dev tasks grow, a look at a time, up to max_tasks; 0 = splits.dev",
    )
    # 5: a first coin generation distilled 7-9 candidates, and the procedures, guardrails and
    # exemplars among them were futile in every gate with the shipped model (bench/RESULTS.md)
    max_candidates: int = Field(
        default=5,
        ge=0,
        le=MANY,
        description="candidates of one family gated in one generation, best evidence first (the kind's "
        "priority, then distinct train tasks they came from); the rest wait, still candidates; 0 = all",
    )
    replay: bool = Field(
        default=True,
        description="greedy arms: a candidate that only adds rules is not played on a dev task its rules "
        "cannot change (the baseline is replayed under them: skills/replay.py)",
    )


class EvolveSettings(Section):
    """`ratchet evolve`: how many generations, and where rollouts run."""

    generations: int = Field(
        default=1, ge=1, le=10_000, description="generations after the baseline (generation 0)"
    )
    task_runner: Literal["threads", "dask", "ray"] = Field(
        default="threads",
        description="Prefect task runner for rollouts: threads (default), dask or ray (install the extra)",
    )
    workers: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="dask/ray worker processes (default 2); the threads runner uses `concurrency`",
    )
    watchdog_s: float = Field(
        default=900.0,
        ge=0,
        le=DAY_S,
        description="end a run that makes no progress (no rollout, step or stage finished) for this "
        "long, with every thread's stack in the logs; rerun to resume (0 = off)",
    )


class DashboardSettings(Section):
    """`ratchet dashboard`: its port, and where its links to MLflow and Prefect point."""

    port: int = Field(default=8780, ge=1, le=65535, description="port on 127.0.0.1")
    mlflow_url: str = Field(
        default="http://127.0.0.1:5000",
        description="MLflow UI the generation links open (`mlflow ui --backend-store-uri <mlflow_uri>`)",
    )
    prefect_url: str = Field(
        default="",
        description="Prefect UI the flow-run links open; empty = PREFECT_UI_URL, else the host of "
        "PREFECT_API_URL, else http://127.0.0.1:4200",
    )


class LoraSettings(Section):
    """LoRA hyperparameters (peft). Part of an adapter's identity: change one and it trains anew."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(default=16, ge=1, le=4096, description="LoRA rank r")
    alpha: int = Field(
        default=32, ge=1, le=65_536, description="LoRA scaling alpha (effective scale alpha/r)"
    )
    dropout: float = Field(default=0.05, ge=0, lt=1)
    targets: tuple[str, ...] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj"), min_length=1, description="modules to adapt"
    )
    lr: float = Field(default=5e-4, gt=0, le=1, description="AdamW learning rate (linear decay to 0)")
    epochs: int = Field(default=3, ge=1, le=1000)
    batch_size: int = Field(default=8, ge=1, le=4096, description="examples per optimizer step")
    shared_prefixes: bool = Field(
        default=False,
        description="run each batch's shared prompt tokens once (a prefix tree, the same gradient "
        "but for dropout's masks): 1.35x faster, held-out effect not settled (bench/bf16_lora.py)",
    )
    max_tokens: int = Field(
        default=1024, ge=16, le=1_000_000, description="longer examples are dropped, not truncated"
    )
    seed: int = Field(default=0, ge=0, le=INT64_MAX)


class DpoSettings(Section):
    """DPO on preference pairs at the step where a success and a failure of one task part
    (training/preference.py), after SFT, on the same adapter. Part of an adapter's identity."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        default=False,
        description="train the adapter further with DPO on the train split's preference pairs (TRL); "
        "off until its held-out effect is measured",
    )
    min_pairs: int = Field(default=4, ge=1, le=1_000_000, description="fewer pairs: SFT only")
    per_task: int = Field(default=4, ge=1, le=1000, description="pairs kept per task")
    beta: float = Field(default=0.1, gt=0, le=100, description="DPO's temperature on the log-ratio margin")
    lr: float = Field(default=5e-5, gt=0, le=1, description="learning rate of the DPO pass")
    epochs: int = Field(default=2, ge=1, le=1000)
    batch_size: int = Field(default=4, ge=1, le=4096, description="pairs per optimizer step")


class FinetuneSettings(Section):
    """The fine-tune stage: which successes become data, and whether to train or export."""

    mode: Literal["auto", "lora", "export", "off"] = Field(
        default="auto",
        description="lora: train an adapter here; export: write the dataset (OpenAI fine-tuning JSONL) "
        "for a remote model; auto: lora on the embedded model, export for a remote endpoint; off: skip "
        "the stage (skills, rules and tools only)",
    )
    experts: bool = Field(
        default=False, description="also learn from expert trajectories (reported; the headline is without)"
    )
    per_task: int = Field(default=2, ge=1, le=1000, description="shortest distinct successes kept per task")
    loops: Literal["cut", "drop"] = Field(
        default="cut",
        description="successes with a loop: cut = learn all but the repeated turns; drop = learn none",
    )
    min_new_successes: int = Field(
        default=4,
        ge=0,
        le=MANY,
        description="skip the stage unless this many kept successes walk an action path no earlier "
        "adapter learned (a rollout repeating a learned path under a new id is no new data)",
    )
    # True: in the two first generations measured where skills changed the champion before the
    # fine-tune stage (coin, bench/RESULTS.md), the adapter trained then took 6.9 and 7.0 min and
    # failed its gate against the new champion both times
    wait_for_champion: bool = Field(
        default=True,
        description="skip training in a generation whose verify changed the champion after explore: "
        "the adapter would be gated against a champion none of its data came from; it trains in a "
        "later generation, on rollouts the new champion played",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)
    dpo: DpoSettings = Field(default_factory=DpoSettings)


class SkillSettings(Section):
    k: int = Field(
        default=3, ge=0, le=100, description="promoted skills shown per task (most relevant first)"
    )
    token_budget: int = Field(
        default=400, ge=0, le=1_000_000, description="prompt tokens the shown skills may take"
    )
    exemplars: int = Field(default=2, ge=0, le=100, description="solved tasks an exemplar set shows per task")
    exemplar_budget: int = Field(
        default=300, ge=0, le=1_000_000, description="prompt tokens shown solved tasks may take"
    )


class SplitSizes(Section):
    """Tasks per subset. The defaults are the smallest that show the loop turning on the
    embedded model, robustly: a rule that repairs a quarter of the dev tasks needs 5 repairs
    without a regression to pass the gate, and a gain on the test split needs 10 tasks to be
    seen. With 16 dev tasks that pass was a coin toss (the gate admits a 0.27-per-task gain
    43% of the time; on coin the no-repeat rule repaired exactly 5 of the first 16 in fp32 and
    3 in bf16). With 32 it is admitted 86% of the time, and a candidate that changes nothing
    still stops after 8 tasks (`verify.futility`; bench/gate_efficiency.py).

    8 train tasks and 20 test tasks: with 4 train tasks x 2 rollouts a first coin generation
    found one rule (7/10 against random's 66%); with 8 it also found `prefer take coin` and a
    macro tool, and the gate promoted all three in each of 3 fresh runs (12/20 against 55%
    under the action budget, 12.5 min in bf16: bench/results/readme_action_budget_bf16.json).
    A test split of 10 cannot show a gain over random at all: a task random always solves is
    a tie, and a sign test over the rest needs 9 of 10 better."""

    train: int = Field(default=8, ge=1, le=SPLIT_MAX, description="train tasks per subset")
    dev: int = Field(
        default=32, ge=1, le=SPLIT_MAX, description="dev tasks per subset (the A/B gate needs 5 or more)"
    )
    test: int = Field(default=20, ge=1, le=SPLIT_MAX, description="test tasks per subset")


ENTRY_POINT = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"  # 'module:attribute', as a console script names one
COMMAND_ARGS, COMMAND_ARG_CHARS = 256, 4096  # an agent's command line: far past any real one
AGENT_NAME_CHARS = 500  # an agent's name as records show it (an MLflow param holds 6,000)


class AgentSettings(Section):
    """Your own agent in place of ratchet's actor (docs/your-agent.md): called once per task
    with the task's input and a base URL of the intervention endpoint (`endpoint/`), which
    records its model calls and applies the policy of the arm the rollout plays. In ratchet's
    process (`entry`), or as a program of its own with its own virtualenv (`command`)."""

    entry: str = Field(
        default="",
        pattern=rf"{ENTRY_POINT}|^$",
        description="'module:function' of your agent, imported with the working directory on the path; "
        "empty: ratchet's own actor plays the suite's tools (or `command` runs your agent)",
    )
    kind: Literal["function", "langgraph", "command"] = Field(
        default="function",
        description="'function': entry(task_input, base_url) returns the answer; 'langgraph': "
        "entry(base_url) returns a compiled graph, invoked with {'messages': [task input]}, whose last "
        "message is the answer; 'command': `command` runs once per task in a process group of its own "
        "(endpoint/process.py)",
    )
    command: list[str] = Field(
        default_factory=list,
        max_length=COMMAND_ARGS,
        description="kind 'command': the program and its arguments, e.g. ['agent-venv/bin/python', "
        "'agent.py'], run from the working directory; the task input as JSON on stdin, the answer on "
        "stdout, OPENAI_BASE_URL (and RATCHET_MCP_URL) in its environment",
    )
    timeout_s: float = Field(
        default=600.0, gt=0, le=DAY_S, description="one task's wall time; past it the rollout is an error"
    )
    mcp: bool = Field(
        default=False,
        description="your agent loads MCP tools: its entry is also given `mcp_url` (a command: "
        "RATCHET_MCP_URL), the rollout's MCP server of distilled tools, and distill drafts function tools "
        "for it; false: no tool is drafted",
    )

    @field_validator("command")
    @classmethod
    def _plain_arguments(cls, v: list[str]) -> list[str]:
        for i, arg in enumerate(v):
            if "\0" in arg or len(arg) > COMMAND_ARG_CHARS:
                raise ValueError(f"argument {i} holds a NUL byte or is over {COMMAND_ARG_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _one_agent(self) -> AgentSettings:
        """An entry point for the in-process kinds, a command for 'command', never both: a setting
        silently ignored would run another agent than the one meant."""
        if self.kind != "command":
            if self.command:
                raise ValueError(f"agent.command is for kind = 'command' (kind is {self.kind!r})")
            return self
        if self.entry:
            raise ValueError(
                "kind 'command' runs agent.command, and agent.entry is set too: unset one "
                "(entry runs in ratchet's process, command in a process of its own)"
            )
        if not self.command or not self.command[0]:
            raise ValueError("kind 'command' needs agent.command, e.g. ['agent-venv/bin/python', 'agent.py']")
        if shutil.which(self.command[0]) is None:
            raise ValueError(
                f"agent.command's program {self.command[0]!r} is not an executable file (from "
                f"{os.getcwd()}, or on PATH): create the virtualenv it names, or fix the path"
            )
        return self

    @property
    def name(self) -> str:
        """Your agent as records show it: its entry point, or its command line (cut to fit an
        MLflow param); '' for ratchet's own actor, so it also says whether your agent plays."""
        if self.kind == "command" and self.command:
            line = shlex.join(self.command)
            return line if len(line) <= AGENT_NAME_CHARS else line[: AGENT_NAME_CHARS - 1] + "…"
        return self.entry


class TaskFileSettings(Section):
    """A suite from your own data: one JSON object per line, with `input` (what your agent is
    given) and optionally `id` and any fields your scoring function reads (`suites/task_file.py`)."""

    file: Path | None = Field(default=None, description="the JSONL task file; set, it is the suite")
    score: str = Field(
        default="",
        pattern=rf"{ENTRY_POINT}|^$",
        description="'module:function' scoring one answer: score(item, answer) returns a bool, or "
        "(bool, score)",
    )
    max_steps: int = Field(
        default=20, ge=1, le=10_000, description="model calls one rollout may make (the step budget)"
    )

    @field_validator("file")
    @classmethod
    def _names_jsonl(cls, v: Path | None) -> Path | None:
        if v is not None and v.suffix != ".jsonl":
            raise ValueError("must name a .jsonl file (one JSON object per line)")
        return v


class TrafficSettings(Section):
    """Learning from use: what the gateway served becomes tasks of the next generations
    (`flows/traffic.py`). Only for a task-file suite: a user's expected answer fills a field of
    an item, and the file's scoring function scores it like any other."""

    learn: bool = Field(
        default=False,
        description="each generation of `ratchet evolve` starts by turning the gateway's recorded "
        "requests that carry an expected answer into train and dev tasks",
    )
    expectation: str = Field(
        default="answer",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$",
        description="the task item field a user's expected answer fills (the field tasks.score reads)",
    )
    share: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="at most this share of a generation's train and of its dev tasks come from use "
        "(the task file's items fill the rest; the test split is the file's alone)",
    )

    @field_validator("expectation")
    @classmethod
    def _not_a_key_of_its_own(cls, v: str) -> str:
        if v in ("id", "input", "from_use"):
            raise ValueError(f"'{v}' is a key of every learned item: name the field your scorer reads")
        return v


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RATCHET_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
    )

    data_dir: Path = Field(default=Path(".ratchet"), description="all state lives here")
    evolution: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]+$", description="evolution name")
    suite: str = Field(
        # coin: the game the shipped 135M model can learn from its own successes (bench/rft_gain.py);
        # mapreader and sorting cost 25-step rollouts it fails (all three: 'textworld-express')
        default="textworld-express:coin",
        description="suite plug-in, optionally with subsets: 'reasoning-gym:chain_sum,countdown'",
    )
    seed: int = Field(
        default=0, ge=0, le=INT64_MAX, description="base seed: task sampling and rollout seeds derive from it"
    )
    concurrency: int = Field(
        default=8, ge=1, le=1024, description="rollouts in flight at once (the server batches them)"
    )
    max_steps: int | None = Field(
        default=None, ge=1, le=10_000, description="override the suite's step budget"
    )
    history_window: int = Field(
        default=10,
        ge=1,
        le=10_000,
        description="past steps shown to the model (trimmed in half-window blocks: prefixes stay cacheable)",
    )
    compact_repeats: bool = Field(
        # bench/results/compact_obs.json, coin, 30 test tasks: rollouts 1.3-1.5x faster, but with the
        # no-repeat rule 14/30 instead of 18/30 (0 repairs, 4 regressions): off until a policy
        # is shown not to lose by it
        default=False,
        description="a past tool result the model can already read word for word (in the task or "
        "earlier in the history window) is shown as its first sentence and a note: fewer tokens",
    )
    trace_sample_rate: float = Field(
        # bench/results/trace_overhead.json: no measurable throughput loss at 0.25 or 1.0; a trace is ~140 KB
        default=0.25,
        ge=0,
        le=1,
        description="share of explore and evaluate rollouts traced to MLflow (LangGraph autolog), picked "
        "by a hash of task id and rollout index: the same ones every run and generation; 0 = off",
    )
    model: ModelSettings = Field(default_factory=ModelSettings)
    splits: SplitSizes = Field(default_factory=SplitSizes)
    explore: ExploreSettings = Field(default_factory=ExploreSettings)
    evaluate: EvaluateSettings = Field(default_factory=EvaluateSettings)
    teacher: TeacherSettings = Field(default_factory=TeacherSettings)
    diagnose: DiagnoseSettings = Field(default_factory=DiagnoseSettings)
    distill: DistillSettings = Field(default_factory=DistillSettings)
    skills: SkillSettings = Field(default_factory=SkillSettings)
    verify: VerifySettings = Field(default_factory=VerifySettings)
    finetune: FinetuneSettings = Field(default_factory=FinetuneSettings)
    evolve: EvolveSettings = Field(default_factory=EvolveSettings)
    dashboard: DashboardSettings = Field(default_factory=DashboardSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    tasks: TaskFileSettings = Field(default_factory=TaskFileSettings)
    traffic: TrafficSettings = Field(default_factory=TrafficSettings)

    @model_validator(mode="after")
    def _task_file_is_the_suite(self) -> Settings:
        """With `tasks.file` set, the suite is that file ('tasks:<file stem>'); naming another
        suite beside it is an error, not a setting silently ignored."""
        t = self.tasks
        if t.file is None:
            if self.traffic.learn:
                raise ValueError(
                    "traffic.learn needs tasks.file: a user's expected answer becomes a task item "
                    "that the file's scoring function scores"
                )
            return self
        if not t.score:
            raise ValueError("tasks.file needs tasks.score, the 'module:function' that scores an answer")
        name = task_file_suite_name(t.file)
        if "suite" in self.model_fields_set and self.suite not in ("tasks", name):
            raise ValueError(f"set either suite ({self.suite!r}) or tasks.file ({t.file}), not both")
        self.suite = name
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = config_path()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    # --- where things live under data_dir -------------------------------------------------
    @property
    def trajectories_db(self) -> Path:
        return self.data_dir / "trajectories.db"

    @property
    def skills_dir(self) -> Path:
        return self.data_dir / "skills"

    @property
    def index_dir(self) -> Path:
        return self.data_dir / "index"

    @property
    def mlflow_uri(self) -> str:
        """MLflow's database URL. MLflow makes the database's directory from this URL's path as
        written, still percent-encoded (`x/q%3Fx/.ratchet` beside the real `x/q?x/.ratchet`), and
        only for a URL that starts `sqlite:///`: a path that needs encoding gets the same driver
        named (`sqlite+pysqlite:///`), which SQLAlchemy opens alike and MLflow makes no directory
        for (the data dir exists before MLflow starts)."""
        db = (self.data_dir / "mlflow.db").resolve()
        return sqlite_url(db, "sqlite" if quote(str(db), safe="/") == str(db) else "sqlite+pysqlite")

    @property
    def mlflow_artifacts(self) -> Path:
        return (self.data_dir / "mlartifacts").resolve()

    @property
    def prefect_home(self) -> Path:
        return (self.data_dir / "prefect").resolve()

    @property
    def models_dir(self) -> Path:
        return (self.data_dir / "models").resolve()

    @property
    def evolve_journal(self) -> Path:
        """Which stages of which generation finished (`ratchet evolve` resumes from it)."""
        return self.data_dir / "evolutions" / f"{self.evolution}.json"

    @property
    def adapters_dir(self) -> Path:
        return (self.data_dir / "adapters").resolve()

    @property
    def logs_dir(self) -> Path:
        return (self.data_dir / "logs").resolve()

    @property
    def traffic_file(self) -> Path:
        """The tasks learned from use (`flows/traffic.py` writes it, the task-file suite reads it)."""
        return self.data_dir / "traffic" / f"{self.evolution}.jsonl"


def task_file_suite_name(path: Path) -> str:
    """The suite spec of a task file: 'tasks:<stem>', the stem cut to the characters a task
    id's subset may hold."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem).strip("-.") or "tasks"
    return f"tasks:{stem}"


def settings_from(config: str | None, overrides: dict[str, Any] | None = None) -> Settings:
    """Settings for a flow a deployment started: TOML file (or ./ratchet.toml) < RATCHET_* env < overrides."""
    return load_settings(overrides, config_file=Path(config) if config else None)


def load_settings(overrides: dict[str, Any] | None = None, config_file: Path | None = None) -> Settings:
    """Build settings, turning any problem with the file, the environment or a value into one
    readable ConfigError line."""
    if config_file is not None:
        check_config_file(config_file, "--config", "check the --config path")
        os.environ[CONFIG_ENV] = str(config_file)
    check_environment()
    path = config_path()
    try:
        return Settings(**_nest(overrides or {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "settings"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(
            f"invalid setting {where}: {first['msg']}{more}",
            "fix it in ratchet.toml, the RATCHET_* environment or the flag",
        ) from None
    except SettingsError as exc:  # a section's variable (RATCHET_MODEL='{...}') that is not JSON
        raise ConfigError(f"cannot read settings: {_first_line(exc)}", "fix the RATCHET_* variable") from None
    except Exception as exc:  # malformed TOML, bytes that are not UTF-8, an unreadable file
        where = f" from {path}" if path is not None else ""
        raise ConfigError(f"cannot read settings{where}: {_first_line(exc)}", "fix the config file") from None


def config_path() -> Path | None:
    """The TOML file settings come from: `RATCHET_CONFIG` (set by `--config`), else
    ./ratchet.toml if anything has that name (None if nothing does). A path naming no regular
    file is an error: read as "no settings" it would run with the defaults, silently."""
    named = os.environ.get(CONFIG_ENV, "")  # empty, like unset: the default file
    if named:
        check_config_file(Path(named), CONFIG_ENV, f"point {CONFIG_ENV} at a TOML file, or unset it")
        return Path(named)
    path = Path(DEFAULT_CONFIG_FILE)
    if not os.path.lexists(path):
        return None
    check_config_file(path, "", f"move it away, or name a settings file with --config or {CONFIG_ENV}")
    return path


def check_config_file(path: Path, named_by: str, fix: str) -> None:
    """A config path must be a regular file: not a directory, a FIFO (reading it would block)
    or a link to nothing."""
    if path.is_file():
        return
    if path.is_dir():
        problem = "is a directory"
    elif path.exists():
        problem = "is not a regular file"
    elif os.path.lexists(path):
        problem = "does not exist (a broken symbolic link)"
    else:
        problem = "does not exist"
    by = f" (named by {named_by})" if named_by else ""
    raise ConfigError(f"config file {path} {problem}{by}", fix)


def env_names(model: type[BaseModel] = Settings, prefix: str = ENV_PREFIX) -> set[str]:
    """Every environment variable a setting is read from, sections included (they take JSON)."""
    names: set[str] = set()
    for field, info in model.model_fields.items():
        name = f"{prefix}{field.upper()}"
        names.add(name)
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            names |= env_names(info.annotation, f"{name}__")
    return names


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """A `RATCHET_*` variable that no setting and no part of ratchet reads is an error naming
    the nearest known one: a misspelt `RATCHET_CONCURENCY=2` would otherwise be ignored.
    Settings match in any case, as pydantic-settings reads them; the others (`RATCHET_CONFIG`,
    `RATCHET_FAULT`, ...) only as spelt, as that is how they are read."""
    env = os.environ if environ is None else environ
    settings = env_names()
    suffixes = sorted(k.removeprefix(ENV_PREFIX) for k in settings | set(OTHER_VARIABLES))
    unknown = []
    for name in sorted(env):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in settings:
            continue
        if name in OTHER_VARIABLES or name.startswith(TEST_VARIABLES):
            continue
        near = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), suffixes, n=1, cutoff=0.6)
        unknown.append(f"{name} (did you mean {ENV_PREFIX}{near[0]}?)" if near else name)
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        raise ConfigError(
            f"unknown environment variable{plural} {', '.join(unknown)}",
            "rename or unset it: RATCHET_* variables set settings, nested with __ "
            "(e.g. RATCHET_MODEL__ENDPOINT)",
        )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{'model.endpoint': x} -> {'model': {'endpoint': x}}; None values mean 'not given'."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if value is None:
            continue
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
