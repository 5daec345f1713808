"""Prefect flow `finetune`: LoRA on the policy's own clean successes, gated like any candidate.

    dataset (training/dataset.py) → train (training/lora.py; then DPO on preference pairs,
      training/preference.py, with `finetune.dpo`) → register (MLflow model version)
      → gate: the champion with vs without the adapter, paired on the dev split (flows/verify)
      → verified → `champion` alias (auto) or a person (`ratchet adapters promote`); else rejected

Resumable at every point: the dataset is a content hash of its examples; an adapter already
registered for this dataset and LoRA config is reused instead of trained again; a killed
training leaves no adapter (written to a temp dir, renamed); the gate's rollouts are stored
under the adapter's arm and replayed from the store on a rerun; the alias moves in one call.

Each adapter is trained from the base model on every clean success so far (not on top of
the previous adapter): reproducible from its dataset alone, and no drift compounds across
generations. The stage is skipped when fewer than `finetune.min_new_successes` kept successes
walk an action path no earlier adapter learned: a rollout that repeats a learned path under a
new id is no new data (`training/dataset.py:new_paths`), and when no adapter could pass its
gate: the champion, greedy on the same seeds, solves so many of the dev tasks that fewer are
left to repair than a pass needs (`flows/verify.py:foreclosed`), and in a generation whose
verify changed the champion after explore (`champion_changed`): the adapter would be gated
against a champion none of its data came from; the next generation explores with it.
With a remote policy endpoint (`finetune.mode = "auto"`) there are no local weights to train:
the stage writes the dataset as an OpenAI fine-tuning JSONL file, says where, and the loop
goes on. `finetune.mode = "off"` skips the stage and
leaves the live adapter, if any, live: the loop then improves only through skills, rules
and tools.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import mlflow
from prefect import flow

from ratchet import faults
from ratchet.config import Settings
from ratchet.files import write_text_atomic
from ratchet.flows import evaluations, progress, tracking
from ratchet.flows.gate import file_verdict, promote_verified
from ratchet.flows.runtime import LoopRuntime, check_dev_size, open_runtime, policy_with
from ratchet.flows.verify import dev_split, foreclosed, gate_evidence, run_gates
from ratchet.hashing import content_hash
from ratchet.lifecycle import batch
from ratchet.memory.trajectory_store import TrajectoryStore
from ratchet.server.launcher import ensure_adapter
from ratchet.server.precision import dtype_name
from ratchet.skills.intervention import GateDecision
from ratchet.training.dataset import Dataset, build_dataset, new_paths
from ratchet.training.preference import PreferencePair, preference_pairs, write_pairs
from ratchet.training.registry import ADAPTER_FILES, AdapterRegistry, AdapterVersion, adapter_sha256
from ratchet.types import Policy, Task, Trajectory

if TYPE_CHECKING:
    from rich.console import Console

Action = Literal["skipped", "exported", "trained", "reused"]


@dataclass
class FinetuneResult:
    action: Action
    reason: str
    dataset: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    version: int | None = None
    status: str | None = None  # where the adapter ended: verified, promoted, rejected
    decision: GateDecision | None = None
    export_path: str | None = None
    train_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The journal's record of the stage (`ratchet.flows.stage.StageOutcome`)."""
        return {
            "action": self.action,
            "reason": self.reason,
            "version": self.version,
            "status": self.status,
            "dataset": self.dataset,
        }

    def render(self, console: Console, settings: Settings, run_id: str | None = None) -> None:
        from ratchet.flows import display

        display.finetune(console, self)


def finetune_mode(s: Settings) -> Literal["lora", "export", "off"]:
    """auto: train on the embedded model (its weights are here); export for a remote endpoint."""
    if s.finetune.mode != "auto":
        return s.finetune.mode
    return "export" if s.model.endpoint else "lora"


def config_hash(s: Settings) -> str:
    doc = {"model": s.model.name, "lora": s.finetune.lora.model_dump(mode="json")}
    if s.finetune.dpo.enabled:  # off, the hash is what it was before DPO existed: old adapters still match
        doc["dpo"] = s.finetune.dpo.model_dump(mode="json")
    return content_hash(doc, length=12)


def preference_data(s: Settings, store: TrajectoryStore) -> list[PreferencePair]:
    """The train split's preference pairs (training/preference.py) when `finetune.dpo` is on
    and there are at least `min_pairs` of them; else none (the adapter is SFT only)."""
    if not s.finetune.dpo.enabled:
        return []
    runs = store.query(evolution=s.evolution, split="train", status="finished", kind="agent")
    pairs = preference_pairs(runs, s.finetune.dpo.per_task)
    return pairs if len(pairs) >= s.finetune.dpo.min_pairs else []


def data_version(data: Dataset, pairs: list[PreferencePair]) -> str:
    """What an adapter is trained on: the SFT dataset's version, and the pairs' if any."""
    return (
        data.version if not pairs else content_hash([data.version, sorted(p.key for p in pairs)], length=12)
    )


def train_successes(s: Settings, store: TrajectoryStore) -> list[Trajectory]:
    """Every finished success of the evolution's train split so far (experts only if configured)."""
    kinds = {"agent", "expert"} if s.finetune.experts else {"agent"}
    found = store.query(evolution=s.evolution, split="train", success=True, status="finished")
    return [t for t in found if t.kind in kinds]


def champion_changed(rt: LoopRuntime, generation: int, champion: Policy) -> str | None:
    """Why training waits, if this generation's explore played another champion than the live one
    (verify promoted something since); None if it played this one, or this generation explored nothing."""
    s = rt.settings
    played = {
        t.policy_version
        for t in rt.store.summaries(evolution=s.evolution, generation=generation, split="train", kind="agent")
    }
    if not played or champion.version in played:
        return None
    return (
        f"the champion changed after this generation's explore (policy {champion.version}, explored "
        f"with {', '.join(sorted(played))}): training waits for rollouts it played "
        "(finetune.wait_for_champion)"
    )


def training_dataset(s: Settings, successes: list[Trajectory]) -> Dataset:
    """The dataset the stage trains on: the clean ones of `train_successes`."""
    return build_dataset(successes, s.finetune.per_task, s.finetune.loops == "drop")


def finetune_stage(rt: LoopRuntime, generation: int, who: str = "finetune") -> FinetuneResult:
    s = rt.settings
    successes = train_successes(s, rt.store)
    data = training_dataset(s, successes)
    counts = dict(data.counts)
    if finetune_mode(s) == "off":  # the live adapter, if any, stays live
        return FinetuneResult("skipped", "finetune.mode = 'off'", data.version, counts)
    if mlflow.active_run() is not None:
        mlflow.log_metrics({f"finetune_data_{k}": float(v) for k, v in counts.items()})
    if finetune_mode(s) == "export":
        path = data.write_openai_jsonl(s.data_dir / "finetune" / f"dataset-{data.version}.jsonl")
        if mlflow.active_run() is not None:
            mlflow.log_artifact(str(path), "finetune")
        why = f"{s.model.endpoint} is a remote model: no weights to train here; {len(data.examples)} examples"
        return FinetuneResult("exported", why, data.version, counts, export_path=str(path))
    registry = AdapterRegistry(s)
    pairs = preference_data(s, rt.store)
    version = data_version(data, pairs)
    counts["preference_pairs"] = len(pairs)
    adapter = registry.find(version, config_hash(s))
    action: Action = "reused"
    seconds = 0.0
    if adapter is None:
        new = new_paths(data, successes, _trained_sources(registry))
        need = s.finetune.min_new_successes
        if not data.examples or len(new) < need:
            why = (
                f"{len(new)} new clean successes (action paths no earlier adapter learned; "
                f"finetune.min_new_successes={need})"
            )
            return FinetuneResult("skipped", why, version, counts)
        champion = rt.live_policy()
        if s.finetune.wait_for_champion and (why := champion_changed(rt, generation, champion)):
            return FinetuneResult("skipped", why, version, counts)
        if (stop := foreclosed(rt, generation, champion, _dev_tasks(rt, champion, generation))) is not None:
            why = f"no adapter could pass its gate: {stop.reason}"
            return FinetuneResult("skipped", why, version, counts)
        adapter, seconds = _train(rt, registry, data, pairs, who)
        action = "trained"
    result = FinetuneResult(action, "", version, counts, adapter.version, adapter.status)
    result.train_seconds = seconds
    with batch():  # MLflow's agent versions (a lifecycle listener) follow these decisions once, at the end
        if adapter.status == "candidate":
            adapter = _gate(rt, registry, adapter, generation, who, result)
            faults.point("adapter.decided")
        pending = [adapter.name] if adapter.status == "verified" else []
        if promote_verified(registry, pending, who, s.verify.promotion):
            adapter = registry.get(adapter.version)
    result.status = adapter.status
    result.reason = result.reason or f"adapter version {adapter.version} is {adapter.status}"
    if adapter.champion:
        rt.adapter = adapter
    if mlflow.active_run() is not None:
        mlflow.log_text(json.dumps(_summary(result), indent=2), "finetune/summary.json")
        # the adapter's gate as an evaluation (of the agent version it made live, if it did)
        if result.decision is not None:
            name = f"adapter-v{adapter.version}"
            evaluations.gate(s, generation, name, "adapter", "all", adapter.status, adapter.evidence)
    return result


def _train(
    rt: LoopRuntime, registry: AdapterRegistry, data: Dataset, pairs: list[PreferencePair], who: str
) -> tuple[AdapterVersion, float]:
    from ratchet.training.lora import fit_adapter  # torch and peft load only when training

    s = rt.settings
    cfg = s.finetune.lora
    version = data_version(data, pairs)
    path = data.write_openai_jsonl(s.adapters_dir / "datasets" / f"{version}.jsonl")
    write_text_atomic(path.with_suffix(".sources.json"), json.dumps(sorted(data.sources)))
    if pairs:  # beside it, for a person to read: the prompt, the chosen and the rejected call
        write_pairs(pairs, path.with_suffix(".pairs.jsonl"))
    out = s.adapters_dir / ".training" / f"{version}-{config_hash(s)}"

    def on_step(step: int, total: int, loss: float) -> None:
        progress.report("finetune", step, total)
        if mlflow.active_run() is not None:
            mlflow.log_metric("finetune_loss", loss, step=step)

    # bf16 products under autocast where `model.dtype` means bf16 on this CPU (it has bf16
    # units): 1.39x faster, the same held-out success (training/lora.py); fp32 elsewhere
    autocast = dtype_name(s.model.dtype) == "bfloat16"
    seconds = 0.0
    if not all((out / f).is_file() for f in ADAPTER_FILES):  # else: trained before a kill, not registered
        trained, too_long = fit_adapter(
            s.models_dir, data.examples, out, cfg, on_step, autocast=autocast, pairs=pairs, dpo=s.finetune.dpo
        )
        seconds = trained.wall_seconds + (trained.dpo.wall_seconds if trained.dpo else 0.0)
        if mlflow.active_run() is not None:
            dpo = trained.dpo
            mlflow.log_metrics(
                {
                    "finetune_wall_seconds": trained.wall_seconds,
                    "finetune_steps": float(trained.steps),
                    "finetune_examples": float(trained.examples),
                    "finetune_too_long": float(too_long),
                    "finetune_tokens": float(trained.tokens),
                    "finetune_model_tokens": float(trained.model_tokens),
                    "finetune_final_loss": trained.losses[-1],
                    **(
                        {
                            "finetune_dpo_pairs": float(dpo.pairs),
                            "finetune_dpo_too_long": float(trained.dpo_too_long),
                            "finetune_dpo_steps": float(dpo.steps),
                            "finetune_dpo_seconds": dpo.wall_seconds,
                            "finetune_dpo_final_loss": dpo.losses[-1] if dpo.losses else float("nan"),
                        }
                        if dpo
                        else {}
                    ),
                }
            )
        faults.point("adapter.trained")
    sha = adapter_sha256(out)
    run = mlflow.active_run()
    run_id, source = "", str(registry.local_dir(sha))  # outside a tracked run: only the local copy
    if run is not None:
        _log_dataset(data, path)
        params = {f"lora_{k}": v for k, v in cfg.model_dump(mode="json").items()}
        tracking.log_params(params | {"lora_precision": "bf16-autocast" if autocast else "float32"})
        mlflow.log_artifacts(str(out), f"adapters/{sha[:12]}")
        run_id, source = run.info.run_id, f"{run.info.artifact_uri}/adapters/{sha[:12]}"
    adapter = registry.register(out, run_id, source, version, config_hash(s), who)
    faults.point("adapter.registered")
    shutil.rmtree(out, ignore_errors=True)  # the registry keeps its own copy
    return adapter, seconds


def _gate(
    rt: LoopRuntime,
    registry: AdapterRegistry,
    adapter: AdapterVersion,
    generation: int,
    who: str,
    result: FinetuneResult,
) -> AdapterVersion:
    """The adapter is an intervention: champion with vs without it, same dev tasks, same seeds."""
    s = rt.settings
    champion = rt.live_policy()
    tasks = _dev_tasks(rt, champion, generation)
    check_dev_size(s, {"all families": len(tasks)})
    ensure_adapter(
        rt.base_url,
        adapter.served_name,
        registry.checked_path(adapter),
        s.model.api_key.get_secret_value(),
    )
    candidate = policy_with(champion, [adapter])  # the champion served through the adapter
    arm = f"adapter-{adapter.sha256[:12]}"
    gates = run_gates(rt, generation, champion, {arm: (candidate, tasks)}, {arm: arm})
    decision = gates.decisions[arm]
    evidence = gate_evidence(decision, champion, candidate, gates.outcomes[arm])
    result.decision, result.reason = decision, decision.reason
    if mlflow.active_run() is not None:
        mlflow.log_metrics(
            {"finetune_gate_repairs": decision.repairs, "finetune_gate_regressions": decision.regressions}
        )
    file_verdict(registry, adapter.name, decision, evidence, who)
    return registry.get(adapter.version)


def _dev_tasks(rt: LoopRuntime, champion: Policy, generation: int) -> list[Task]:
    """The adapter's gate plays the dev tasks of every family: an adapter changes them all."""
    return [t for family in dev_split(rt, champion, generation).values() for t in family]


def _trained_sources(registry: AdapterRegistry) -> set[str]:
    """Trajectory ids every earlier adapter of this evolution was trained on."""
    out: set[str] = set()
    for v in registry.list():
        path = registry.root / "datasets" / f"{v.dataset}.sources.json"
        if path.is_file():
            out.update(json.loads(path.read_text()))
    return out


def _log_dataset(data: Dataset, path: Path) -> None:
    """The dataset version as an MLflow dataset input (name, digest, counts) plus its JSONL file."""
    import pandas as pd

    rows = [
        {"trajectory_id": e.trajectory_id, "task_id": e.task_id, "step": str(e.step)} for e in data.examples
    ]
    with warnings.catch_warnings():  # MLflow finds two equal readings of a local path and says so
        warnings.simplefilter("ignore", UserWarning)
        ds = mlflow.data.from_pandas(pd.DataFrame(rows), source=str(path), name=f"sft-{data.version}")
    mlflow.log_input(ds, context="finetune", tags={k: str(v) for k, v in data.counts.items()})
    mlflow.log_artifact(str(path), "finetune")


def _summary(r: FinetuneResult) -> dict[str, object]:
    d = {k: v for k, v in r.__dict__.items() if k != "decision"}
    if r.decision is not None:
        d["decision"] = r.decision.__dict__
    return d


@flow(name="finetune", validate_parameters=False)
def finetune_flow(settings: Settings, generation: int = 0, base_url: str | None = None) -> FinetuneResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation):
        return finetune_stage(rt, generation)
