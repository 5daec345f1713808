"""What the benchmarks share: options, data dirs, the model server, result files, paired arms.

A benchmark is a module `bench/NAME.py` whose name does not start with `_` (this module and
`_`-modules are shared code, not benchmarks). It has

* a docstring: its first line says what it measures (`python -m bench` lists it), the rest
  is its `--help`;
* `Options`, a dataclass whose fields are its command-line options: `--field-name`, typed by
  the annotation (`bool` is a switch, `list[X]` takes one or more values), with `option(...)`
  for the help line, another flag (`-k`), choices or nargs;
* `run(opts: Options) -> int | None`, the benchmark itself (its return value is the exit code).

`python -m bench NAME [options]` parses the options and calls `run`; results go through
`write_result`, which keeps the options beside the numbers.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
MODELS = ROOT / ".ratchet" / "models"  # the checkout's converted model, shared by every bench
SHARED = ("harness",)  # modules of bench/ that are not benchmarks (besides the `_` ones)

# ----------------------------------------------------------------------------- options


def option(default: Any = MISSING, help: str = "", *, flags: Sequence[str] = (), **argparse_kw: Any) -> Any:
    """A field of a benchmark's `Options`: its default (none: the option is required), its help
    line, and when needed other flags than `--field-name` or more argparse keywords (nargs,
    choices, metavar, type, positional=True for an argument without a flag)."""
    meta = {"help": help, "flags": tuple(flags), "kw": argparse_kw}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.required else super()._get_help_string(action)


def _default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def parser(options: type, prog: str, description: str | None) -> argparse.ArgumentParser:
    """An argparse parser with one argument per field of the dataclass `options`."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=_Help)
    hints = typing.get_type_hints(options)
    for f in fields(options):
        kw = dict(f.metadata.get("kw", {}))
        positional = kw.pop("positional", False)
        tp = hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None: X
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        default = _default(f)
        if tp is bool:
            kw.setdefault("action", argparse.BooleanOptionalAction if default else "store_true")
        elif typing.get_origin(tp) is list:
            kw.setdefault("nargs", "+")
            kw.setdefault("type", typing.get_args(tp)[0])
        else:
            kw.setdefault("type", tp)
        kw["help"] = f.metadata.get("help") or "(default: %(default)s)"
        if positional:
            p.add_argument(f.name, **kw)
            continue
        if f.default is MISSING and f.default_factory is MISSING:
            kw["required"] = True
        flags = f.metadata.get("flags") or (f"--{f.name.replace('_', '-')}",)
        p.add_argument(*flags, dest=f.name, default=default, **kw)
    return p


def arguments(opts: Any) -> dict[str, Any]:
    """The options a run was given, as plain JSON values (paths as strings)."""

    def plain(v: Any) -> Any:
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return str(v) if isinstance(v, Path) else v

    return {f.name: plain(getattr(opts, f.name)) for f in fields(opts)}


# ----------------------------------------------------------------------------- the registry


def names() -> list[str]:
    """Every benchmark in bench/, by module name."""
    return sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_") and p.stem not in SHARED)


def summary(name: str) -> str:
    """The first line of a benchmark's docstring, read without importing it."""
    doc = ast.get_docstring(ast.parse((BENCH / f"{name}.py").read_text()))
    return doc.strip().splitlines()[0] if doc else ""


def listing() -> str:
    rows = [(n, summary(n)) for n in names()]
    width = max(len(n) for n, _ in rows)
    head = "python -m bench NAME [options]   (python -m bench NAME --help: its options)\n"
    return head + "\n".join(f"  {n:<{width}}  {s}" for n, s in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench`: the list; `python -m bench NAME ...`: run one."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    name = args[0].removesuffix(".py").replace("-", "_")
    if name not in names():
        near = difflib.get_close_matches(name, names(), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        print(
            f"python -m bench: no benchmark {args[0]!r}{hint}; `python -m bench` lists them", file=sys.stderr
        )
        return 2
    module = importlib.import_module(f"bench.{name}")
    p = parser(module.Options, f"python -m bench {name}", module.__doc__)
    opts = module.Options(**vars(p.parse_args(args[1:])))
    from ratchet.runtime_env import offline_environment
    from ratchet.shutdown import stop_on_signals

    stop_on_signals()  # Ctrl-C and kill unwind: `with` blocks stop the servers a bench started
    offline_environment()  # a bench's first flow may start Prefect before any settings are prepared
    return int(module.run(opts) or 0)


# ----------------------------------------------------------------------------- data and server


def fresh_data_dir(prefix: str) -> Path:
    """A new temporary data dir whose models/ is the checkout's converted model (linked, not
    converted again: ~20 s), or the test session's when no run has converted one yet."""
    data = Path(tempfile.mkdtemp(prefix=prefix))
    for shared in (MODELS, ROOT / ".ratchet" / "test-models"):
        if shared.exists():
            (data / "models").symlink_to(shared, target_is_directory=True)
            break
    return data


def clean_env() -> dict[str, str]:
    """This process's environment without ratchet's, Prefect's and MLflow's variables: what a
    new user's shell has (a run then reads only the settings it is given)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}


def evolve_outcome(
    data: Path, overrides: dict[str, str], code: int, wall: float, output: str
) -> dict[str, Any]:
    """What a finished `ratchet evolve` on `data` shows: its exit code and minutes, the last
    generation's held-out result beside random's with the sign test's p, every generation's
    row (from the journal) and the end of what it printed."""
    from ratchet.agents.baselines import beats_random
    from ratchet.config import load_settings
    from ratchet.flows.journal import Journal

    settings = load_settings({"data_dir": data, **overrides})  # the run's journal path
    rows = [asdict(r) for r in Journal.load(settings).rows()] if code == 0 else []
    last = rows[-1] if rows else {}
    p = last.get("vs_random_p")
    return {
        "exit_code": code,
        "wall_minutes": round(wall / 60, 2),
        "test": f"{last.get('test_successes')}/{last.get('test_n')}" if last else None,
        "random": last.get("random_success"),
        "vs_random_p": p,
        "above_random": beats_random(p),
        "promoted": [name for r in rows for name in r["promoted"]],
        "rows": rows,
        "output_tail": output.splitlines()[-12:],
    }


def bench_settings(data_dir: Path, overrides: dict[str, Any]) -> Any:
    """Settings on `data_dir` with `overrides` (dotted keys, as `--set` takes them), the
    environment prepared (Prefect, MLflow and Hugging Face pointed at the data dir)."""
    from ratchet.config import load_settings
    from ratchet.runtime_env import prepare_environment

    settings = load_settings({"data_dir": data_dir, **overrides})
    prepare_environment(settings)
    return settings


def embedded_server(
    logs: Path,
    dtype: str = "auto",
    models: Path = MODELS,
    server_args: Sequence[str] = (),
    memray: Path | None = None,
    kv_cache_mb: int | None = None,
    kv_dtype: str = "auto",
) -> Any:
    """The embedded model server (`with embedded_server(dir) as url:`), its log in `logs`;
    `server_args`: more `python -m ratchet.server` flags; `memray`: run it under `memray run
    --aggregate`, writing the capture there (read it with memory_breakdown.breakdown);
    `kv_cache_mb`, `kv_dtype`: the key-value pool's budget and number format (`model.kv_cache_mb`,
    `model.kv_dtype`; None and auto: the server's defaults)."""
    from ratchet.server.launcher import EmbeddedServer

    runner = () if memray is None else ("-m", "memray", "run", "--aggregate", "-f", "-o", str(memray))
    profiled = {} if memray is None else {"stop_signal": signal.SIGINT, "stop_timeout_s": 600.0}
    return EmbeddedServer(  # memray writes its capture as the server exits (EmbeddedServer.stop_signal)
        models,
        logs,
        dtype=dtype,
        kv_cache_mb=kv_cache_mb,
        kv_dtype=kv_dtype,
        server_args=tuple(server_args),
        runner=runner,
        **profiled,  # type: ignore[arg-type]
    )


def server_stats(url: str) -> dict[str, float]:
    """The server's counters and clocks from /health (prefill, decode, busy seconds, tokens)."""
    import urllib.request

    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as r:  # noqa: S310 - loopback
        doc = json.loads(r.read())
    return {k: float(v) for k, v in doc.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def install_champion(settings: Any, adapter_dir: Path) -> None:
    """Make a trained LoRA adapter the champion (as a person would promote it), once."""
    from ratchet.training.registry import AdapterRegistry

    registry = AdapterRegistry(settings)
    if registry.champion() is not None:
        return
    v = registry.register(adapter_dir, None, str(adapter_dir), "bench", "bench", who="bench")
    registry.transition(v.name, "verified", who="bench", why="given", evidence={"decision": "accept"})
    registry.transition(v.name, "promoted", who="bench", why="the policy under test")


# ----------------------------------------------------------------------------- results


def write_result(
    name: str, result: dict[str, Any], opts: Any = None, *, path: Path | None = None, indent: int = 2
) -> Path:
    """Keep a run: `{"args": its options, **result}` as JSON in bench/results/<name>.json (or
    `path`). Existing result files are the record of RESULTS.md: pick a new name for a new run."""
    out = path or RESULTS / f"{name}.json"
    doc = ({} if opts is None else {"args": arguments(opts)}) | result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=indent, default=str) + "\n")
    print(f"wrote {out}")
    return out


def child_json(code: str, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run `code` in a fresh Python (`args` as its argv, `env` added to this environment) and
    return the JSON its last printed line holds: a measurement that must not share a process
    with another (a library's dispatch read once at load, an ISA limit, a warm allocator)."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- statistics


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """The exact binomial interval of k successes in n."""
    from scipy.stats import beta

    a = (1 - conf) / 2
    lo = 0.0 if k == 0 else float(beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def rate_ratio_interval(
    x1: int, n1: float, x2: int, n2: float, conf: float = 0.95
) -> tuple[float, float | None]:
    """The exact interval of the ratio of two event rates, x1 in n1 against x2 in n2 (events
    per model call, say): conditional on x1 + x2, x1 is binomial with p = R n1 / (R n1 + n2),
    so the Clopper-Pearson interval of p gives R's. None: no upper bound (x2 = 0). Where the
    second rate has no point estimate (no event at all), the lower bound still says how much
    higher the first is, at least."""
    if x1 + x2 == 0:
        return 0.0, None
    lo, hi = clopper_pearson(x1, x1 + x2, conf)
    scale = n2 / n1

    def ratio(p: float) -> float | None:
        return None if p >= 1 else p / (1 - p) * scale

    return ratio(lo) or 0.0, ratio(hi)


def interval_text(lo: float, hi: float | None) -> str:
    """A ratio's interval as the benches print it (`hi` None: no upper end)."""
    return f"{lo:.2f}x to " + ("unbounded" if hi is None else f"{hi:.2f}x")


def paired(base: dict[str, float], arm: dict[str, float]) -> dict[str, Any]:
    """Repairs and regressions of `arm` against `base`, task by task, with the exact McNemar p."""
    from ratchet.skills.intervention import binomial_p_value

    repairs = sum(1 for t, v in arm.items() if v > base.get(t, 0.0))
    regressions = sum(1 for t, v in arm.items() if v < base.get(t, 0.0))
    p = binomial_p_value(repairs, repairs + regressions) if repairs + regressions else 1.0
    return {"repairs": repairs, "regressions": regressions, "p_value": p}


# ----------------------------------------------------------------------------- paired arms

COUNTERS = ("prompt_tokens", "prefilled_tokens", "prefill_seconds", "busy_seconds", "requests")
POLICIES = ("base", "base + no-repeat")


@dataclass(frozen=True)
class Arm:
    """One way to play the same held-out tasks: a server, settings, an adapter, extra rules."""

    url: str
    settings: dict[str, Any] = field(default_factory=dict)
    adapter: Path | None = None  # a trained adapter dir, loaded into the arm's server and played
    rules: tuple[Any, ...] = ()  # RuleSpecs played on top of the policy (e.g. the ones a run kept)


def evaluate_arms(
    family: str,
    arms: dict[str, Arm],
    data: Path,
    test: int,
    concurrency: int = 8,
    policies: tuple[str, ...] = POLICIES,
) -> dict[str, Any]:
    """The real `evaluate` stage, greedy, on the first `test` test tasks of `family`, for each
    policy (the base model alone; with the no-repeat rule the loop promotes first on coin) in
    each arm, same tasks and seeds. Per row: test success, the server's counters (`COUNTERS`)
    and wall time; every arm after the first is compared with the first task by task
    (repairs, regressions, the exact one-sided p of a gain and of a loss).
    `{"family": ..., "arms": [row per policy and arm]}`; arms alternate within a policy."""
    from prefect import flow

    from ratchet.flows.evaluate import evaluate_stage
    from ratchet.flows.runtime import open_runtime
    from ratchet.server.launcher import ensure_adapter
    from ratchet.training.registry import adapter_sha256, served_name
    from ratchet.types import RuleSpec

    settings = bench_settings(
        data / family.replace(":", "-"),
        {"suite": family, "splits.test": test, "evaluate.baseline_seeds": 0, "concurrency": concurrency},
    )

    def with_rules(policy: Any, name: str) -> Any:
        if name == "base":
            return policy
        return policy.model_copy(update={"rules": (RuleSpec(name="no-repeat", no_repeat=True),)})

    def for_arm(policy: Any, arm: Arm) -> Any:
        """`policy` plus the arm's own rules and adapter (loaded into the arm's server)."""
        if arm.rules:
            policy = policy.model_copy(update={"rules": (*policy.rules, *arm.rules)})
        if arm.adapter is None:
            return policy
        sha = adapter_sha256(arm.adapter)
        ensure_adapter(arm.url, served_name(sha), arm.adapter)
        return policy.model_copy(update={"adapter": served_name(sha), "adapter_hash": sha})

    @flow(name="paired-arms", validate_parameters=False)
    def one_family() -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        generation = 10
        first = next(iter(arms))  # every other arm is compared with it
        for name in policies:
            by_task: dict[str, dict[str, float]] = {}
            for arm_name, arm in arms.items():
                arm_settings = settings.model_copy(update=arm.settings)
                with open_runtime(arm_settings, arm.url) as rt:
                    policy = for_arm(with_rules(rt.base_policy(), name), arm)
                    before, started = server_stats(arm.url), time.perf_counter()
                    report = evaluate_stage(rt, generation, policy).report
                    wall = time.perf_counter() - started
                    after = server_stats(arm.url)
                generation += 1
                by_task[arm_name] = report.by_task
                row = {
                    "policy": name,
                    "arm": arm_name,
                    "successes": report.successes,
                    "n": report.n,
                    "rate": report.success_rate,
                    "ci95": list(report.ci95),
                    "wall_s": round(wall, 1),
                    **{k: round(after.get(k, 0) - before.get(k, 0), 2) for k in COUNTERS},
                }
                if arm_name != first:
                    row |= paired(by_task[first], by_task[arm_name])
                    row["loss_p_value"] = paired(by_task[arm_name], by_task[first])["p_value"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        return {"family": family, "arms": rows}

    return one_family()


def arms_table(families: list[dict[str, Any]], first: str) -> str:
    """`evaluate_arms` results as a markdown table."""
    lines = [
        f"| family | policy | arm | test success | vs {first}: +repairs / −regressions | prompt tok | "
        "prefilled tok | prefill s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fam in families:
        for a in fam["arms"]:
            vs = "—" if "repairs" not in a else f"+{a['repairs']} / −{a['regressions']}"
            game = fam["family"].split(":")[-1]
            lines.append(
                f"| {game} | {a['policy']} | {a['arm']} | {a['successes']}/{a['n']} | {vs} | "
                f"{a['prompt_tokens']:,.0f} | {a['prefilled_tokens']:,.0f} | {a['prefill_seconds']:.0f} | "
                f"{a['wall_s']:.0f} |"
            )
    return "\n".join(lines)
