"""SkillRetriever against real Chroma and MiniLM: relevance, k, budget, membership, the
in-memory path for skills missing from the index, and determinism."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import ratchet.memory.retrieval as retrieval
from ratchet.memory.retrieval import SkillRetriever, estimate_tokens, skill_document
from ratchet.memory.vector_index import DIM, VectorIndex
from ratchet.types import SkillText


def _skill(name: str, description: str, body: str) -> SkillText:
    return SkillText(name=name, description=description, body=body)


COIN = _skill("take-coin", "Pick up coins you see", "When a coin is in the room, take coin before moving on.")
LIBRARY = [
    COIN,
    _skill("open-doors", "Open closed doors first", "If a door is closed, open door, then go through it."),
    _skill("carry-digits", "Add numbers column by column", "Add the units first and carry the ten."),
    _skill(
        "use-calculator", "Use the calculator for arithmetic", "Never compute in your head; call calculator."
    ),
    _skill("countdown", "Reach a target number", "Combine the given numbers with + - * / to hit the target."),
    _skill("sort-by-weight", "Sort objects by weight", "Weigh each object and place the lightest first."),
    _skill(
        "avoid-loops", "Stop walking in circles", "Keep a list of visited rooms; never go back and forth."
    ),
    _skill("cook-meal", "Follow the recipe", "Read the cookbook, slice and fry what it lists, then eat."),
]
COIN_TASK = "Your task is to find the coin. You are in the kitchen; pick it up."
MATH_TASK = "Calculate 348 + 97 - 12. Give the final answer as an integer."


def _retriever(tmp_path: Path, skills: list[SkillText] = LIBRARY, **kwargs: int) -> SkillRetriever:
    r = SkillRetriever(VectorIndex(tmp_path / "index", "skills"), **kwargs)
    r.sync(skills)
    return r


def test_estimate_tokens_is_ceil_chars_over_four() -> None:
    assert [estimate_tokens(t) for t in ["", "abc", "abcd", "abcde"]] == [0, 1, 1, 2]


def test_sync_is_keyed_by_content_hash_and_idempotent(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    r = SkillRetriever(VectorIndex(tmp_path / "index", "skills"))
    assert r.sync(LIBRARY + [COIN], batch_size=3, progress=lambda d, t: seen.append((d, t))) == len(LIBRARY)
    assert seen == [(3, 8), (6, 8), (8, 8)]
    assert r.sync(LIBRARY) == 0
    assert r.index.ids() == sorted(s.content_hash for s in LIBRARY)
    hit = r.index.get([COIN.content_hash])[0]
    assert hit.document == skill_document(COIN)
    assert hit.metadata == {"name": "take-coin", "tokens": estimate_tokens(skill_document(COIN))}

    edited = COIN.model_copy(update={"body": COIN.body + " Then check the inventory."})
    assert r.sync([edited]) == 1 and r.index.count() == len(LIBRARY) + 1
    # A fresh retriever learns what is stored from the index itself.
    assert SkillRetriever(r.index).sync(LIBRARY + [edited]) == 0


# exact_limit=0 sends every indexed skill set through the index's ANN query; the default
# scores a small set exactly. Both must give the same answers.
PATHS = pytest.mark.parametrize("exact_limit", [0, 256], ids=["ann", "exact"])


@PATHS
def test_select_finds_the_relevant_skill(tmp_path: Path, exact_limit: int) -> None:
    r = _retriever(tmp_path, exact_limit=exact_limit)
    assert r.select(COIN_TASK, LIBRARY, k=1) == [COIN]
    assert {s.name for s in r.select(MATH_TASK, LIBRARY, k=2)} <= {
        "carry-digits",
        "use-calculator",
        "countdown",
    }


@PATHS
def test_select_respects_k(tmp_path: Path, exact_limit: int) -> None:
    r = _retriever(tmp_path, exact_limit=exact_limit)
    for k in range(len(LIBRARY) + 2):
        assert len(r.select(COIN_TASK, LIBRARY, k=k, token_budget=10_000)) == min(k, len(LIBRARY))
    assert r.select(COIN_TASK, [], k=3) == []


def test_select_respects_the_token_budget(tmp_path: Path) -> None:
    big = _skill("coin-hoarding", "Collect every coin in the game", "Take every coin. " * 200)
    r = _retriever(tmp_path, LIBRARY + [big])
    skills = LIBRARY + [big]
    ranked = [s for s, _ in r.rank(COIN_TASK, skills, k=3)]
    assert big in ranked[:2]  # relevant, but alone over the budget

    chosen = r.select(COIN_TASK, skills, k=3, token_budget=400)
    assert big not in chosen and chosen == [s for s in ranked if s is not big]  # skipped, the rest kept
    tokens = [estimate_tokens(skill_document(s)) for s in chosen]
    assert sum(tokens) <= 400
    assert r.select(COIN_TASK, skills, k=3, token_budget=tokens[0]) == chosen[:1]
    assert r.select(COIN_TASK, skills, k=3, token_budget=tokens[0] - 1) == []
    assert r.select(COIN_TASK, skills, k=3, token_budget=0) == []


@PATHS
def test_select_only_returns_the_given_skills(tmp_path: Path, exact_limit: int) -> None:
    # The index holds the coin skill and many coin-like skills of other policies.
    others = [
        _skill(f"coin-variant-{i}", f"Take coin number {i}", f"Pick up coin {i} at once.") for i in range(40)
    ]
    r = _retriever(tmp_path, LIBRARY + others, exact_limit=exact_limit)
    policy = [s for s in LIBRARY if s is not COIN]
    for k in (1, 3, 7):
        chosen = r.select(COIN_TASK, policy, k=k, token_budget=10_000)
        assert len(chosen) == k and set(chosen) <= set(policy)


def test_ann_escalation_and_exact_fallback_agree_with_exact(tmp_path: Path) -> None:
    others = [
        _skill(f"coin-variant-{i}", f"Take coin number {i}", f"Pick up coin {i} at once.") for i in range(40)
    ]
    exact = _retriever(tmp_path, LIBRARY + others)
    policy = [s for s in LIBRARY if s is not COIN]
    want = exact.rank(COIN_TASK, policy, k=3)
    for max_ann in (12, 512):  # 12: give up on ANN after one query; 512: ask again for more
        ann = SkillRetriever(exact.index, exact_limit=0, max_ann=max_ann)
        got = ann.rank(COIN_TASK, policy, k=3)
        assert [s for s, _ in got] == [s for s, _ in want]
        np.testing.assert_allclose([d for _, d in got], [d for _, d in want], atol=1e-5)
        assert ann.rank(COIN_TASK, policy, k=3) == got  # and again, after a fallback


@PATHS
def test_skills_missing_from_the_index_are_embedded_in_memory_and_merged(
    tmp_path: Path, exact_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    champion = [s for s in LIBRARY if s is not COIN]
    r = _retriever(tmp_path, champion, exact_limit=exact_limit)
    arm = champion + [COIN]  # an A/B arm: the champion plus one candidate not in the index

    got = r.rank(COIN_TASK, arm, k=4)
    assert got[0][0] == COIN
    assert r.index.count() == len(champion)  # selecting never writes

    # Same ranking and distances as if the candidate had been in the index all along.
    full = _retriever(tmp_path / "full", LIBRARY, exact_limit=exact_limit)
    want = full.rank(COIN_TASK, arm, k=4)
    assert [s for s, _ in got] == [s for s, _ in want]
    np.testing.assert_allclose([d for _, d in got], [d for _, d in want], atol=1e-5)

    # The candidate's embedding is cached: a new query embeds only the query.
    calls: list[int] = []
    real = retrieval.embed
    monkeypatch.setattr(retrieval, "embed", lambda texts: calls.append(len(texts)) or real(texts))
    r.select(MATH_TASK, list(arm), k=3)
    r.select(MATH_TASK, list(arm), k=3)
    assert calls == [1]


def test_skills_deleted_behind_the_retrievers_back_are_still_ranked(tmp_path: Path) -> None:
    r = _retriever(tmp_path)
    r.index.delete([COIN.content_hash])
    assert r.select(COIN_TASK, LIBRARY, k=1) == [COIN]


@PATHS
def test_select_is_deterministic(tmp_path: Path, exact_limit: int) -> None:
    r = _retriever(tmp_path, exact_limit=exact_limit)
    want = r.select(MATH_TASK, LIBRARY, k=3)
    shuffled = LIBRARY[:]
    random.Random(0).shuffle(shuffled)
    assert r.select(MATH_TASK, shuffled, k=3) == want
    assert r.select(MATH_TASK, LIBRARY + [LIBRARY[2]], k=3) == want  # duplicates count once
    assert SkillRetriever(r.index, exact_limit=exact_limit).select(MATH_TASK, LIBRARY, k=3) == want
    with ThreadPoolExecutor(4) as pool:
        assert all(got == want for got in pool.map(lambda _: r.select(MATH_TASK, LIBRARY, k=3), range(8)))


def test_equal_distances_break_ties_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    same = np.zeros(DIM, dtype=np.float32)
    same[0] = 1.0
    monkeypatch.setattr(retrieval, "embed", lambda texts: np.tile(same, (len(texts), 1)))
    r = SkillRetriever(VectorIndex(tmp_path / "index", "skills"))  # empty: everything in memory
    names = [s.name for s in r.select(COIN_TASK, LIBRARY[::-1], k=3, token_budget=10_000)]
    assert names == sorted(s.name for s in LIBRARY)[:3]
