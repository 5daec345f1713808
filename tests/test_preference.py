"""Preference pairs where a success and a failure of one task part, and DPO on them
(`training/preference.py`), against real played trajectories and the real model."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.agents.rollout import Start
from ratchet.agents.testing import call
from ratchet.config import load_settings
from ratchet.training.preference import divergence, dpo_rows, preference_pairs
from tests.test_search import played, searched


def test_a_pair_is_the_step_where_a_success_and_a_failure_that_saw_the_same_part():
    win = played(["up", "up"])  # 0 → 1 → 2: solved
    loss = played(["up", "down", "down", "down", "down"], rollout=1)
    assert divergence(win, loss) == 1
    (pair,) = preference_pairs([win, loss, loss])  # the same pair once
    assert pair.chosen.messages == pair.rejected.messages  # the same prompt, word for word
    assert pair.chosen.step == pair.rejected.step == 1
    assert '"up"' in pair.chosen.target["tool_calls"][0]["function"]["arguments"]
    assert '"down"' in pair.rejected.target["tool_calls"][0]["function"]["arguments"]
    # runs that part at the first step pair there; two failures or two successes never pair
    first = played(["down", "up", "up", "down", "down"], rollout=2)
    assert divergence(win, first) == 0
    assert preference_pairs([loss, first]) == [] and preference_pairs([win]) == []


def test_runs_that_saw_different_things_or_were_played_by_other_policies_do_not_pair():
    win = played(["up", "up"])
    loss = played(["up", "down", "down", "down", "down"], rollout=1)
    other = loss.model_copy(update={"prompt": loss.prompt.model_copy(update={"system": "another policy"})})
    assert preference_pairs([win, other]) == []
    moved = loss.model_copy(deep=True)
    moved.steps[1].observation = "value 9"  # not the state the success was in
    assert divergence(win, moved) is None and preference_pairs([win, moved]) == []
    dev = loss.model_copy(update={"split": "dev"})
    assert preference_pairs([win.model_copy(update={"split": "dev"}), dev]) == []  # train only
    capped = [played(["up", "down", a, "down", "down"], rollout=i) for i, a in enumerate(["up", "down"], 3)]
    assert len(preference_pairs([win, loss, *capped], per_task=1)) == 1


def test_a_searched_success_pairs_with_its_failed_parent_at_the_branch():
    parent = played(["up", "down", "down", "down", "down"])
    start = Start(parent=parent.id, prefix=tuple(parent.steps[:1]), away=frozenset({"act: down"}))
    child, _ = searched(start, [call("act", action="up")] * 3)
    assert child.success and child.branch is not None and child.steps[1].source == "search"
    (pair,) = preference_pairs([parent, child])
    assert pair.chosen.trajectory_id == child.id and pair.rejected.trajectory_id == parent.id
    assert pair.chosen.step == child.branch.step == 1


def test_rows_are_rendered_with_the_models_chat_template_and_end_their_turn():
    from ratchet.conformance.budget import shipped_tokenizer

    tok = shipped_tokenizer()
    win, loss = played(["up", "up"]), played(["up", "down", "down", "down", "down"], rollout=1)
    pairs = preference_pairs([win, loss])
    (row,), too_long = dpo_rows(pairs, tok, 4096)
    assert too_long == 0 and row["prompt"].endswith("<|im_start|>assistant\n")
    assert row["chosen"] == '{"name":"act","arguments":{"action":"up"}}<|im_end|>'
    assert row["rejected"] == '{"name":"act","arguments":{"action":"down"}}<|im_end|>'
    assert dpo_rows(pairs, tok, 16) == ([], 1)  # too long is dropped, never cut


@pytest.mark.integration  # the real base model (converted by the embedded server), peft and TRL
def test_dpo_moves_the_adapter_toward_the_chosen_call_and_it_reloads(base_model_dir: Path, tmp_path: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ratchet.training.lora import load_for_training, save_adapter
    from ratchet.training.preference import train_dpo

    s = load_settings({})
    model, tok = load_for_training(base_model_dir, s.finetune.lora)
    win, loss = played(["up", "up"]), played(["up", "down", "down", "down", "down"], rollout=1)
    (row,), _ = dpo_rows(preference_pairs([win, loss]), tok, 4096)

    def margin(m: object) -> float:
        """log p(chosen) - log p(rejected) of the completions after the prompt."""
        out = []
        for key in ("chosen", "rejected"):
            head = tok(row["prompt"])["input_ids"]
            ids = torch.tensor([tok(row["prompt"] + row[key])["input_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(m(input_ids=ids).logits[0, :-1].float(), -1)  # type: ignore[operator]
            picked = logp[torch.arange(len(head) - 1, ids.shape[1] - 1), ids[0, len(head) :]]
            out.append(float(picked.sum()))
        return out[0] - out[1]

    before = margin(model.eval())
    cfg = s.finetune.dpo.model_copy(update={"lr": 1e-3, "epochs": 1, "batch_size": 2})  # one step: CI time
    result = train_dpo(model, tok, [row, row], cfg, seed=0)
    assert result.steps == 1 and len(result.losses) == 1
    after = margin(model)
    assert after > before + 0.5, (before, after)  # the chosen call gained on the rejected one
    save_adapter(model, tmp_path / "adapter")
    fresh = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    assert margin(reloaded) == pytest.approx(after, abs=1e-3)


def test_dpo_is_part_of_an_adapters_identity_only_when_it_is_on(tmp_path: Path):
    from ratchet.flows.finetune import config_hash, data_version, preference_data
    from ratchet.memory.trajectory_store import open_store
    from ratchet.training.dataset import build_dataset

    off = load_settings({"data_dir": tmp_path})
    on = load_settings({"data_dir": tmp_path, "finetune.dpo.enabled": True, "finetune.dpo.min_pairs": 1})
    assert config_hash(off) == config_hash(off.model_copy(update={}))
    assert config_hash(on) != config_hash(off)  # an adapter trained without DPO is not reused for one with
    win, loss = played(["up", "up"]), played(["up", "down", "down", "down", "down"], rollout=1)
    store = open_store(on.trajectories_db)
    for t in (win, loss):
        store.put(t.model_copy(update={"evolution": on.evolution}))
    assert preference_data(off, store) == []  # off: SFT only
    pairs = preference_data(on, store)
    assert len(pairs) == 1
    many = on.model_copy(
        update={
            "finetune": on.finetune.model_copy(
                update={"dpo": on.finetune.dpo.model_copy(update={"min_pairs": 2})}
            )
        }
    )
    assert preference_data(many, store) == []  # fewer than min_pairs: SFT only
    store.close()
    data = build_dataset([win], per_task=2)
    assert data_version(data, []) == data.version and data_version(data, pairs) != data.version
