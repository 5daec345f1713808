"""Fine-tuning for real: peft LoRA training, the finetune flow's gate and registry, the export path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import mlflow
import pytest

from ratchet.agents.rollout import RolloutSlot, run_expert
from ratchet.config import Settings, load_settings
from ratchet.flows import finetune
from ratchet.flows.explore import seed_experts
from ratchet.flows.finetune import finetune_flow
from ratchet.flows.launch import run_flow
from ratchet.flows.runtime import open_runtime
from ratchet.server.launcher import admin_headers
from ratchet.server.precision import dtype_name, native_bf16
from ratchet.suites import get_suite
from ratchet.training.dataset import build_dataset
from ratchet.training.registry import AdapterRegistry, adapter_sha256
from ratchet.types import Trajectory
from tests.conftest import TEST_MODELS
from tests.factories import traj

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _unload_new_adapters(embedded_server: str) -> Any:
    """The server is shared by the whole session: leave it serving what it served before."""
    before = {m["id"] for m in httpx.get(f"{embedded_server}/models").json()["data"]}
    yield
    for m in httpx.get(f"{embedded_server}/models").json()["data"]:
        if m["id"] not in before:
            headers = admin_headers(embedded_server)  # the server's admin routes need its token
            httpx.post(f"{embedded_server}/unload_lora_adapter", json={"lora_name": m["id"]}, headers=headers)


def _coin_examples(n_tasks: int) -> list[Any]:
    suite = get_suite("textworld-express:coin")
    try:
        found = [run_expert(suite, RolloutSlot("e", 0, t, -1)) for t in suite.tasks("train", n_tasks)]
    finally:
        suite.close()
    return build_dataset([t for t in found if t is not None], per_task=1).examples


def test_lora_learns_the_target_turns_and_reloads_identically(base_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ratchet.training.lora import IGNORE, collate, encode_all, load_for_training, target_loss, train_lora

    # two examples, four steps: enough to see it learn, half the CPU time of a batch of four
    cfg = load_settings({}).finetune.lora.model_copy(update={"epochs": 4, "batch_size": 2, "lr": 2e-3})
    model, tok = load_for_training(base_model_dir, cfg)
    # the two shortest gold paths that fit: it learns the same way, in less CPU time
    data = sorted(encode_all(_coin_examples(6), tok, cfg.max_tokens)[0], key=lambda e: len(e.input_ids))[:2]
    assert len(data) == 2
    learned = tok.decode([t for t in data[0].labels if t != IGNORE])
    assert learned.startswith('{"name":"act","arguments":{"action":') and learned.endswith("<|im_end|>")
    ids, labels, mask = collate(data, tok.pad_token_id)
    with torch.no_grad():
        before = target_loss(model.eval(), ids, labels, mask).item()
    out = tmp_path / "adapter"
    result = train_lora(model, data, out, cfg)
    assert result.steps == 4 and all(torch.isfinite(torch.tensor(result.losses)))
    with torch.no_grad():
        after = target_loss(model, ids, labels, mask).item()
        trained_logits = model(input_ids=ids, attention_mask=mask).logits
    assert after < before * 0.7  # it learned its own examples
    assert not list(tmp_path.glob(".adapter-*"))  # written atomically
    fresh = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(fresh, out).eval()
    with torch.no_grad():
        again = reloaded(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(trained_logits, again, atol=1e-4)


@pytest.mark.slow  # in CI: the fine-tune stage's own test trains this way where the CPU has bf16 units
@pytest.mark.skipif(
    not native_bf16(),
    reason="this CPU has no bf16 units: torch emulates bf16 products 9x slower than fp32 "
    "(bench/bf16_emulated.py), and the fine-tune stage trains in fp32 here (model.dtype = auto)",
)
def test_bf16_autocast_trains_the_same_fp32_adapter_with_bf16_products(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """What the fine-tune stage does where the CPU has bf16 units: the matrix products in bf16
    (torch.autocast), everything the adapter is made of (weights, AdamW state, file) in fp32.
    Only there: with emulated bf16 this workload ran past 900 s, and the stage would not use it."""
    import torch
    from safetensors.torch import load_file

    from ratchet.training.lora import (
        accumulate,
        collate,
        encode_all,
        load_for_training,
        target_loss,
        train_lora,
    )

    cfg = load_settings({}).finetune.lora.model_copy(update={"epochs": 4, "batch_size": 2, "lr": 2e-3})
    model, tok = load_for_training(base_model_dir, cfg)
    data = encode_all(_coin_examples(6), tok, cfg.max_tokens)[0][:2]
    ids, labels, mask = collate(data, tok.pad_token_id)
    model.eval()
    exact, fast = accumulate(model, data[:1]), accumulate(model, data[:1], autocast=True)
    model.zero_grad(set_to_none=True)
    assert fast != exact and abs(fast - exact) < 0.05 * exact  # bf16 arithmetic took effect, and is close
    with torch.no_grad():
        before = target_loss(model, ids, labels, mask).item()
    result = train_lora(model, data, tmp_path / "adapter", cfg, autocast=True)
    with torch.no_grad():
        after = target_loss(model, ids, labels, mask).item()
    assert result.steps == 4 and after < before * 0.7  # it learned
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and {t.dtype for t in saved.values()} == {torch.float32}


def _settings(tmp_path: Path, **over: Any) -> Settings:
    data = tmp_path / "data"
    (data).mkdir(parents=True, exist_ok=True)
    if not (data / "models").exists():
        (data / "models").symlink_to(TEST_MODELS)  # the converted base model, shared
    return load_settings(
        {
            "data_dir": data,
            "suite": "reasoning-gym:chain_sum",
            "splits.train": 6,
            "splits.dev": 5,
            "max_steps": 2,
            "concurrency": 4,
            "finetune.experts": True,  # the base model solves almost nothing; experts give data
            "finetune.min_new_successes": 1,
            "finetune.lora.epochs": 2,
            "finetune.lora.batch_size": 4,
            **over,
        }
    )


def _seed(settings: Settings, url: str) -> None:
    with open_runtime(settings, url) as rt:
        assert seed_experts(rt, 0) == 6


def test_finetune_trains_registers_gates_and_resumes_without_repeating(
    embedded_server: str, tmp_path: Path
) -> None:
    settings = _settings(tmp_path)
    _seed(settings, embedded_server)
    result = run_flow(finetune_flow, settings, generation=0, base_url=embedded_server)
    assert result.action == "trained" and result.version == 1 and result.counts["examples"] == 6
    registry = AdapterRegistry(settings)
    v = registry.get(1)
    assert v.status == result.status and v.status in ("promoted", "rejected")
    champion = registry.champion()
    assert (champion is not None and champion.version == 1) == (result.decision.decision == "accept")
    assert (
        v.evidence["tasks"] == len(v.evidence["pairs"]) >= 5 and v.evidence["arm"] != v.evidence["champion"]
    )
    assert adapter_sha256(registry.checked_path(v)) == v.sha256
    # the endpoint serves the adapter by name, beside the base model
    served = [m["id"] for m in httpx.get(f"{embedded_server}/models").json()["data"]]
    assert v.served_name in served and settings.model.name in served
    # MLflow: loss curve, dataset input, the adapter artifact behind the model version
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(v.run_id)
    assert len(client.get_metric_history(v.run_id, "finetune_loss")) == 4  # 2 batches x 2 epochs
    assert any(d.dataset.name == f"sft-{result.dataset}" for d in run.inputs.dataset_inputs)
    bf16 = dtype_name(settings.model.dtype) == "bfloat16"  # this CPU has bf16 units
    assert run.data.params["lora_precision"] == ("bf16-autocast" if bf16 else "float32")
    import torch
    from safetensors.torch import load_file

    saved = load_file(registry.checked_path(v) / "adapter_model.safetensors")
    assert saved and {t.dtype for t in saved.values()} == {torch.float32}  # bf16 products, fp32 adapter
    assert any(
        a.path.endswith("adapter_model.safetensors")
        for a in client.list_artifacts(v.run_id, f"adapters/{v.sha256[:12]}")
    )
    audit = registry.audit()
    # a rerun of the same evolution decides nothing anew: no training, no new version, no new rollouts
    from ratchet.memory.trajectory_store import open_store

    store = open_store(settings.trajectories_db)
    before = store.count()
    store.close()
    again = run_flow(finetune_flow, settings, generation=0, base_url=embedded_server)
    assert again.action == "reused" and again.version == 1 and again.status == v.status
    assert len(registry.list()) == 1 and registry.audit() == audit
    store = open_store(settings.trajectories_db)
    assert store.count() == before
    store.close()


def test_too_few_new_successes_skip_the_stage(embedded_server: str, tmp_path: Path) -> None:
    settings = _settings(tmp_path, **{"finetune.min_new_successes": 100})
    _seed(settings, embedded_server)
    result = run_flow(finetune_flow, settings, generation=0, base_url=embedded_server)
    assert result.action == "skipped" and "6 new clean successes" in result.reason
    assert AdapterRegistry(settings).list() == []


def test_training_waits_for_a_champion_changed_after_explore(embedded_server: str, tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    _seed(settings, embedded_server)

    def explored(generation: int, version: str, i: int) -> Trajectory:
        t = traj(["look"], success=False, tid=f"explored-{generation}-{i}")
        update = {"evolution": settings.evolution, "generation": generation, "policy_version": version}
        return t.model_copy(update=update)

    with open_runtime(settings, embedded_server) as rt:
        live = rt.live_policy()
        # generation 3 explored with another champion (verify promoted a skill since); generation
        # 4 with the live one as well; generation 2 explored nothing
        for t in [explored(3, "0ldchampion0", 0), explored(3, "0ldchampion0", 1)]:
            rt.store.put(t)
        rt.store.put(explored(4, "0ldchampion0", 0))
        rt.store.put(explored(4, live.version, 1))
        assert "champion changed" in (finetune.champion_changed(rt, 3, live) or "")
        assert finetune.champion_changed(rt, 4, live) is None
        assert finetune.champion_changed(rt, 2, live) is None
    result = run_flow(finetune_flow, settings, generation=3, base_url=embedded_server)
    assert result.action == "skipped" and "champion changed" in result.reason
    assert live.version in result.reason
    assert AdapterRegistry(settings).list() == []


def test_a_remote_policy_gets_its_dataset_exported_instead(embedded_server: str, tmp_path: Path) -> None:
    settings = _settings(tmp_path, **{"model.endpoint": embedded_server})  # any non-embedded endpoint
    _seed(settings, embedded_server)
    result = run_flow(finetune_flow, settings, generation=0)
    assert result.action == "exported" and "remote model" in result.reason
    lines = [json.loads(x) for x in Path(result.export_path).read_text().splitlines()]
    assert len(lines) == 6 and all(line["messages"][-1]["tool_calls"] for line in lines)
    assert lines[0]["tools"][0]["function"]["name"] in {"calculator", "answer"}
    assert AdapterRegistry(settings).list() == []


def test_the_next_run_plays_the_champion_adapter_and_refuses_a_tampered_one(
    embedded_server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ratchet.errors import AdapterError

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")
    settings = _settings(tmp_path)
    registry = AdapterRegistry(settings)
    v = registry.register(tmp_path / "adapter", "", "file:///nowhere", "d", "c", who="test")
    registry.transition(v.name, "verified", who="test", why="gate passed", evidence={"decision": "accept"})
    registry.transition(v.name, "promoted", who="test", why="champion")
    with open_runtime(settings, embedded_server) as rt:
        policy = rt.live_policy()
        assert (policy.adapter, policy.adapter_hash) == (v.served_name, v.sha256)
        served = [m["id"] for m in httpx.get(f"{embedded_server}/models").json()["data"]]
        assert v.served_name in served
    # base and adapter side by side on one server, answering differently
    said = {}
    for model in (settings.model.name, v.served_name):
        body = {"model": model, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8}
        reply = httpx.post(f"{embedded_server}/chat/completions", json=body | {"temperature": 0}, timeout=60)
        said[model] = reply.json()["choices"][0]["message"]["content"]
    assert said[settings.model.name] != said[v.served_name]
    (registry.checked_path(v) / "adapter_model.safetensors").write_bytes(b"swapped")
    with pytest.raises(AdapterError, match="sha256"):
        with open_runtime(settings, embedded_server):
            pass
