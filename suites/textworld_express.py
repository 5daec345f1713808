"""TextWorldExpress: fast multi-step text games (Java 17), with valid actions and gold paths.

Each `TextWorldExpressEnv` owns a JVM (~0.3-2 s to start), so a suite keeps a small
thread-safe pool of them: an episode borrows one when it is created and hands it back on
`close()`. Episodes may run concurrently in threads, one env each.

Splits are TWX's own seed folds (train 0-999, dev 10000-10999, test 20000-20999 in
textworld-express 1.1.0), read from the env rather than hard-coded. The Java side does
not check that a seed belongs to the fold it is asked for, so `make_task` does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import TYPE_CHECKING, Any

from ratchet.errors import EnvironmentMissingError
from ratchet.suites.base import ActionError, Episode, StepResult, Suite
from ratchet.types import Split, Task, ToolCall, ToolSpec

if TYPE_CHECKING:
    from textworld_express import TextWorldExpressEnv

MIN_JAVA = 17

# Small, learnable settings per game.
GAME_PARAMS: dict[str, str] = {
    "coin": "numLocations=4,numDistractorItems=0,includeDoors=0,limitInventorySize=0",
    "mapreader": (
        "numLocations=3,maxDistanceApart=2,maxDistractorItemsPerLocation=0,"
        "includeDoors=0,limitInventorySize=0"
    ),
    "sorting": "",
    "cookingworld": "numLocations=1,numIngredients=1,numDistractorItems=0,includeDoors=0,"
    "limitInventorySize=0",
    "twc": "",
    "arithmetic": "",
    "simonsays": "",
    "peckingorder": "",
}

# Fixed step budgets, about 3x a typical gold path as TWX draws it (measured over 100 train
# seeds). Never derived from a run's reference path: keep budgets independent of it.
MAX_STEPS: dict[str, int] = {
    "coin": 15,  # gold ~5.7
    "mapreader": 25,  # gold ~8
    "sorting": 25,  # gold ~8
    "cookingworld": 30,  # gold ~10.5
    "twc": 50,  # gold ~17
    "arithmetic": 15,  # gold 5
    "simonsays": 15,  # gold 5
    "peckingorder": 30,  # gold 9
}

# The env ends an episode by itself after this many moves; the actor's max_steps is the
# real budget, so keep the env's own limit out of the way.
_ENV_STEP_LIMIT = 1_000_000

_java_ok = False
_java_lock = threading.Lock()


def java_major_version(java: str = "java") -> int | None:
    """Major version of the `java` on PATH (8 for '1.8.0'), or None if absent/unparseable."""
    path = shutil.which(java)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if m is None:
        return None
    major = int(m.group(1))
    if major == 1 and m.group(2) is not None:  # '1.8.0_392' style
        major = int(m.group(2))
    return major


def check_java() -> None:
    """Raise EnvironmentMissingError unless Java >= 17 is on PATH (checked once per process)."""
    global _java_ok
    with _java_lock:
        if _java_ok:
            return
        version = java_major_version()
        if version is None or version < MIN_JAVA:
            raise EnvironmentMissingError(
                "Java 17 is not installed (TextWorldExpress needs it)",
                "run ./install.sh or apt-get install openjdk-17-jre-headless",
            )
        _java_ok = True


def _shutdown(env: TextWorldExpressEnv) -> None:
    """Stop an env's JVM; safe to call twice and keeps TWX's __del__ from trying again."""
    try:
        env.close()
    except Exception:  # noqa: BLE001 - the JVM may already be gone
        pass
    env.close = lambda: None  # type: ignore[method-assign]


class _EnvPool:
    """Idle TWX envs for reuse; creates one when none is idle. Thread-safe.

    As many JVMs live as episodes run at once; beyond `max_idle`, returned ones are stopped.
    """

    def __init__(self, check: Any, max_idle: int = 4) -> None:
        self._check = check
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[TextWorldExpressEnv] = []
        self._all: list[TextWorldExpressEnv] = []

    def acquire(self) -> TextWorldExpressEnv:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        self._check()
        from textworld_express import TextWorldExpressEnv

        env = TextWorldExpressEnv(envStepLimit=_ENV_STEP_LIMIT)  # JVM start, outside the lock
        with self._lock:
            self._all.append(env)
        return env

    def release(self, env: TextWorldExpressEnv, broken: bool = False) -> None:
        with self._lock:
            owned = any(e is env for e in self._all)
            if owned and not broken and len(self._idle) < self._max_idle:
                self._idle.append(env)
                return
            if owned:
                self._all = [e for e in self._all if e is not env]
        _shutdown(env)

    @contextmanager
    def borrow(self) -> Iterator[TextWorldExpressEnv]:
        """An env for a short call; one that raised is discarded rather than reused."""
        env = self.acquire()
        broken = True
        try:
            yield env
            broken = False
        finally:
            self.release(env, broken=broken)

    @property
    def size(self) -> int:
        with self._lock:
            return len(self._all)

    def close(self) -> None:
        with self._lock:
            envs, self._all, self._idle = self._all, [], []
        for env in envs:
            _shutdown(env)


def _twx_version() -> str:
    try:
        return metadata.version("textworld-express")
    except metadata.PackageNotFoundError:
        return "unknown"


class TextWorldExpressSuite(Suite):
    """TWX games as tasks; subsets are game names, splits are TWX's seed folds."""

    name = "textworld-express"
    replayable = True  # a game is fixed by its seed, fold and parameters; TWX's moves are deterministic
    description = "TextWorldExpress text games (Java 17): valid actions each turn, gold paths"
    default_subsets = ("coin", "mapreader", "sorting")
    # bump the number when a change here alters a task, its budget or its verdict
    declared_version = f"1+textworld-express-{_twx_version()}"

    def __init__(self, subsets: list[str] | None = None) -> None:
        super().__init__(subsets)
        self._pool = _EnvPool(self.check)
        self._lock = threading.Lock()
        self._fold_seeds: dict[tuple[str, Split], list[int]] = {}
        self._descriptions: dict[tuple[str, Split, int], str] = {}
        self._references: dict[str, list[str] | None] = {}

    @classmethod
    def available_subsets(cls) -> list[str]:
        return list(GAME_PARAMS)

    def check(self) -> None:
        check_java()

    # -- seeds and tasks -------------------------------------------------------------------

    def fold_seeds(self, subset: str, split: Split) -> list[int]:
        """All seeds of a TWX fold for one game, in TWX's order (asked of the env once)."""
        self._check_subset(subset)
        key = (subset, split)
        with self._lock:
            if key in self._fold_seeds:
                return self._fold_seeds[key]
        with self._pool.borrow() as env:
            env.load(subset, GAME_PARAMS[subset])
            getter = {
                "train": env.getValidSeedsTrain,
                "dev": env.getValidSeedsDev,
                "test": env.getValidSeedsTest,
            }[split]
            seeds = [int(s) for s in getter()]
        with self._lock:
            self._fold_seeds[key] = seeds
        return seeds

    def split_sizes(self, subset: str) -> dict[Split, int | None]:
        return {split: len(self.fold_seeds(subset, split)) for split in ("train", "dev", "test")}

    def split_seeds(self, subset: str, split: Split, n: int) -> list[int]:
        seeds = self.fold_seeds(subset, split)
        if n > len(seeds):
            raise ValueError(f"{subset} {split} fold has only {len(seeds)} seeds, asked for {n}")
        return seeds[:n]

    def make_task(self, subset: str, split: Split, seed: int) -> Task:
        self._check_subset(subset)
        if seed not in set(self.fold_seeds(subset, split)):
            raise ValueError(f"seed {seed} is not in TextWorldExpress's {split} fold for {subset}")
        return self.new_task(
            subset,
            split,
            seed,
            instruction=self._task_description(subset, split, seed),
            max_steps=MAX_STEPS[subset],
            spec={
                "game": subset,
                "game_params": GAME_PARAMS[subset],
                "game_fold": split,
                "seed": seed,
            },
        )

    def _task_description(self, subset: str, split: Split, seed: int) -> str:
        key = (subset, split, seed)
        with self._lock:
            if key in self._descriptions:
                return self._descriptions[key]
        with self._pool.borrow() as env:
            _, infos = env.reset(seed=seed, gameFold=split, gameName=subset, gameParams=GAME_PARAMS[subset])
            description = str(infos["taskDescription"]).strip()
        with self._lock:
            self._descriptions[key] = description
        return description

    def _check_subset(self, subset: str) -> None:
        if subset not in GAME_PARAMS:
            raise ValueError(f"unknown TextWorldExpress game {subset!r}")

    # -- episodes --------------------------------------------------------------------------

    def episode(self, task: Task) -> TextWorldExpressEpisode:
        if task.suite != self.name:
            raise ValueError(f"task {task.id!r} is not a {self.name} task")
        return TextWorldExpressEpisode(task, self._pool, self._references)

    @property
    def pool_size(self) -> int:
        """Number of live JVMs this suite owns (idle or lent to an episode)."""
        return self._pool.size

    def close(self) -> None:
        self._pool.close()


def _format_actions(actions: list[str]) -> str:
    return "Valid actions: " + ", ".join(actions)


REFERENCE_DRAWS = 8
"""Gold paths drawn per task; the shortest, loops erased, is the task's reference solution."""

Game = dict[str, Any]  # the keyword arguments of `env.reset` for one task


def reference_path(env: TextWorldExpressEnv, game: Game, draws: int = REFERENCE_DRAWS) -> list[str] | None:
    """The shortest winning path among `draws` of TWX's gold paths, each with its detours erased.

    TWX draws a gold path by an unseeded random walk: for one coin task, 23 of 40 draws were
    the 3-move path and the rest wandered for up to 23 moves, past the task's step budget.
    One draw made the expert trajectories, and the gold baseline, a lottery. Erasing the
    detours (moves that come back to a state already left) and keeping the shortest of a
    few draws, ties broken by the actions' text, gives the same short path on every call
    (measured: the same path from two fresh suites on 48 of 48 tasks of coin, mapreader,
    sorting and twc). Leaves the env wherever the last draw ended: reset it before playing.
    """
    best: list[str] | None = None
    for _ in range(draws):
        if (gold := draw_gold(env, game)) is None:
            continue
        path = _loop_erased(env, game, gold)
        if path is not None and (best is None or (len(path), path) < (len(best), best)):
            best = path
    return best


def draw_gold(env: TextWorldExpressEnv, game: Game) -> list[str] | None:
    """One of TWX's random gold paths for `game` (None where TWX reports an error)."""
    env.reset(**game, generateGoldPath=True)
    gold = [str(a) for a in env.getGoldActionSequence()]
    return gold if gold and not gold[0].startswith("ERROR") else None


def _state(infos: dict[str, Any]) -> tuple[str, str, float]:
    """What a move can change: the room as seen, the inventory, the score."""
    return str(infos["look"]), str(infos["inventory"]), float(infos["score"])


def _loop_erased(env: TextWorldExpressEnv, game: Game, gold: list[str]) -> list[str] | None:
    """`gold` up to its winning move, without the detours that came back to a state seen
    before them; an action that leaves the state as it was ('look around', 'read map') is
    information, not a detour, and stays. None if it never wins (twc appends a move after the
    last object is put away; a path that never wins is no reference solution). The erased
    path is replayed to prove it wins, else `gold` is kept as drawn."""
    _, infos = env.reset(**game)
    path: list[str] = []
    here = _state(infos)
    seen = {here: 0}  # state -> length of the path that last stood in it
    for action in gold:
        _, _, _, infos = env.step(action)
        if infos["taskfailure"]:
            return None
        path.append(action)
        if infos["tasksuccess"]:
            break
        state = _state(infos)
        if state != here and state in seen:  # a detour came back: cut it out
            del path[seen[state] :]
            seen = {s: n for s, n in seen.items() if n <= len(path)}
        seen[state] = len(path)  # a move that changed nothing ('read map') is kept
        here = state
    else:
        return None
    return path if _wins(env, game, path) else _winning_prefix(env, game, gold)


def _wins(env: TextWorldExpressEnv, game: Game, path: list[str]) -> bool:
    """True if `path` wins on its last move and not before."""
    env.reset(**game)
    for i, action in enumerate(path):
        _, _, _, infos = env.step(action)
        if infos["tasksuccess"] or infos["taskfailure"]:
            return bool(infos["tasksuccess"]) and i == len(path) - 1
    return False


def _winning_prefix(env: TextWorldExpressEnv, game: Game, gold: list[str]) -> list[str] | None:
    """`gold` up to its winning move, loops kept (the fallback if erasing broke the path)."""
    env.reset(**game)
    for i, action in enumerate(gold):
        _, _, _, infos = env.step(action)
        if infos["tasksuccess"]:
            return gold[: i + 1]
        if infos["taskfailure"]:
            return None
    return None


def _normalize(action: str) -> str:
    return " ".join(action.strip().lower().split())


class TextWorldExpressEpisode(Episode):
    """One TWX game; borrows a pooled env until `close()`."""

    TOOL = "act"

    def __init__(self, task: Task, pool: _EnvPool, references: dict[str, list[str] | None]) -> None:
        super().__init__(task)
        self._pool = pool
        self._references = references  # the suite's: task id -> reference path, found once
        self._env: TextWorldExpressEnv | None = pool.acquire()
        self._broken = False
        self._started = False
        self._done = False
        self._valid: list[str] = []
        self._taken: list[str] = []

    def _live_env(self) -> TextWorldExpressEnv:
        if self._env is None:
            raise RuntimeError(f"episode for {self.task.id} is closed")
        return self._env

    @property
    def _game(self) -> Game:
        spec = self.task.spec
        return {
            "seed": int(spec["seed"]),
            "gameFold": spec["game_fold"],
            "gameName": spec["game"],
            "gameParams": spec["game_params"],
        }

    def reset(self) -> StepResult:
        env = self._live_env()
        self._broken = True  # until the call returns normally
        _, infos = env.reset(**self._game)
        self._broken = False
        self._taken = []
        self._started = True
        self._done = False
        self._valid = sorted(str(a) for a in infos["validActions"])
        return StepResult(
            observation=str(infos["observation"]).strip(),
            options=_format_actions(self._valid),
            score=float(infos["score"]),
        )

    def tools(self) -> list[ToolSpec]:
        return [
            ToolSpec(
                name=self.TOOL,
                description=(
                    "Take one action in the text game. Pick exactly one of the valid actions "
                    "listed in the latest observation."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "action": {
                            "type": "string",
                            "enum": list(self._valid),
                            "description": "one of the current valid actions, verbatim",
                        }
                    },
                    "required": ["action"],
                    "additionalProperties": False,
                },
            )
        ]

    def step(self, call: ToolCall) -> StepResult:
        env = self._live_env()
        if not self._started:
            raise RuntimeError("reset() the episode before step()")
        if self._done:
            raise RuntimeError(f"episode for {self.task.id} is already over")
        if call.name != self.TOOL:
            raise ActionError(f"unknown tool {call.name!r}; the only tool is {self.TOOL!r}")
        action = call.args.get("action")
        if not isinstance(action, str) or not action.strip():
            raise ActionError("'act' needs an 'action' string: one of the valid actions")
        by_norm = {_normalize(a): a for a in self._valid}
        chosen = by_norm.get(_normalize(action))
        if chosen is None:
            raise ActionError(f"{action!r} is not a valid action now. {_format_actions(self._valid)}")
        self._broken = True
        obs, reward, _, infos = env.step(chosen)
        self._broken = False
        self._taken.append(chosen)
        success = bool(infos["tasksuccess"])
        score = float(infos["score"])
        self._done = success or bool(infos["taskfailure"]) or score >= 1.0
        self._valid = [] if self._done else sorted(str(a) for a in infos["validActions"])
        return StepResult(
            observation=str(obs).strip(),
            options="" if self._done else _format_actions(self._valid),
            done=self._done,
            success=success,
            score=score,
            reward=float(reward),
        )

    def valid_actions(self) -> list[ToolCall]:
        return [ToolCall(name=self.TOOL, args={"action": a}) for a in self._valid]

    def expert_actions(self) -> list[ToolCall] | None:
        """The rest of the reference path, while the actions so far follow it; else None."""
        if not self._started:
            raise RuntimeError("reset() the episode before expert_actions()")
        gold = self._reference()
        if gold is None:
            return None
        if self._done:
            return []
        n = len(self._taken)
        if self._taken != gold[:n]:
            return None
        return [ToolCall(name=self.TOOL, args={"action": a}) for a in gold[n:]]

    def gold_draws(self, n: int) -> list[list[str]]:
        """Up to n distinct winning paths as TWX draws them, detours and all: several different
        successes of one task, for benches that compare them. Reset the episode after."""
        env = self._live_env()
        self._broken = True
        paths: list[list[str]] = []
        for _ in range(n):
            if (gold := draw_gold(env, self._game)) is not None:
                path = _winning_prefix(env, self._game, gold)
                if path is not None and path not in paths:
                    paths.append(path)
        self._broken = False
        self._started = False
        return paths

    def _reference(self) -> list[str] | None:
        """The task's reference path: found on this episode's env the first time any episode
        asks, then the game is put back where it was (it is seed-deterministic)."""
        if self.task.id in self._references:
            return self._references[self.task.id]
        env = self._live_env()
        self._broken = True
        found = reference_path(env, self._game)
        env.reset(**self._game)
        for action in self._taken:
            env.step(action)
        self._broken = False
        return self._references.setdefault(self.task.id, found)  # the first one found wins

    def close(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            self._pool.release(env, broken=self._broken)
