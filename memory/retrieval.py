"""Skill retrieval: which of a policy's skills enter the prompt for one task.

A policy may carry more skills than a small model's prompt can hold, so each task gets the
few most relevant to its instruction, within a token budget. `SkillRetriever.select` picks
them *from the skills it is given* (the policy's), never from the whole index: the index
also holds candidates, rejected and retired skills of every generation.

Two cases shape the design:

* Champion: every skill is already in the index (`sync` put it there). A set larger than
  `exact_limit` is searched with the index's approximate nearest-neighbour query, asking for
  a few times k and keeping the hits that belong to the set; if too few belong, it asks
  for more, and past `max_ann` it scores the set exactly. Smaller sets are always scored
  exactly: their stored embeddings are fetched once and a dot product is cheaper than a
  query.
* A/B arm: the champion's skills plus one candidate not in the index. The missing skills are
  embedded in memory (cached by content hash, so an arm costs one embedding, once) and
  merged with the index hits by distance.

Both cases rank by the same cosine distance, so they agree; ties (distances equal to 1e-6)
break by name, then content hash, which makes selection deterministic. The retriever keeps
the set of ids it believes are in the index: it assumes it is its index's only writer (the
index itself allows one writer process), and a stale belief only costs speed, not results.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ratchet.config import SkillSettings
from ratchet.memory.vector_index import DIM, VectorIndex, embed
from ratchet.types import Policy, SkillText

Chosen = tuple[tuple[SkillText, ...] | None, tuple[SkillText, ...] | None]

__all__ = ["SkillRetriever", "estimate_tokens", "skill_document"]

Progress = Callable[[int, int], None]


def skill_document(skill: SkillText) -> str:
    """The text that is embedded, close to how the actor renders a skill in its prompt."""
    return f"{skill.name}\n{skill.description}\n{skill.body.strip()}"


def estimate_tokens(text: str) -> int:
    """ceil(chars / 4): the usual English average for BPE tokenizers. No tokenizer is loaded
    because the policy's model may change; it errs high on code and numbers, which is the
    safe side for a budget."""
    return math.ceil(len(text) / 4)


@dataclass
class _View:
    """One skill set, prepared for ranking. Built once per distinct set (a policy's skills are
    the same for every task it plays), reused while the set is unchanged."""

    skills: tuple[SkillText, ...]
    by_id: dict[str, SkillText]
    tokens: dict[str, int]
    ann_ids: frozenset[str]  # searched through the index's ANN query
    # Scored in memory: ids and their embeddings, swapped as one tuple so readers never mix them.
    exact: tuple[list[str], np.ndarray]


class SkillRetriever:
    """Keeps skills in a `VectorIndex` (keyed by content hash) and selects the ones a task needs.

    `exact_limit`: indexed skill sets up to this size are scored exactly in memory, larger
    ones through the index's ANN query. `overfetch`: the first ANN query asks for k times
    this many hits. `max_ann`: the most hits one ANN query asks for before the set is scored
    exactly. `cache_size`: embeddings of skills missing from the index, and of queries, kept
    in memory (each ~1.5 KB). Thread-safe: rollout threads may call `select` concurrently.
    """

    def __init__(
        self,
        index: VectorIndex,
        *,
        exact_limit: int = 256,
        overfetch: int = 4,
        max_ann: int = 512,
        cache_size: int = 10_000,
    ) -> None:
        self.index = index
        self.exact_limit = exact_limit
        self.overfetch = overfetch
        self.max_ann = max_ann
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._known: set[str] | None = None  # ids in the index, loaded on first need
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()  # LRU of embeddings by id
        self._views: list[_View] = []  # the few most recently used skill sets, newest first
        self._queries: OrderedDict[str, np.ndarray] = OrderedDict()  # LRU of query embeddings

    # ---- writing

    def sync(
        self, skills: Sequence[SkillText], *, batch_size: int = 256, progress: Progress | None = None
    ) -> int:
        """Add the skills the index does not hold yet; returns how many were added.

        Keyed by content hash, so an edited skill is a new record and rerunning is a no-op.
        `progress(done, total)` is called after each batch."""
        with self._lock:
            known = self._known_ids()
            todo = [(i, s) for i, s in {s.content_hash: s for s in skills}.items() if i not in known]
            for lo in range(0, len(todo), batch_size):
                batch = todo[lo : lo + batch_size]
                docs = [skill_document(s) for _, s in batch]
                self.index.upsert(
                    [i for i, _ in batch],
                    docs,
                    [
                        {"name": s.name, "tokens": estimate_tokens(d)}
                        for (_, s), d in zip(batch, docs, strict=True)
                    ],
                )
                known.update(i for i, _ in batch)
                if progress is not None:
                    progress(min(lo + batch_size, len(todo)), len(todo))
            if todo:
                self._views = []
            return len(todo)

    # ---- reading

    def select(
        self, query: str, skills: Sequence[SkillText], k: int = 3, token_budget: int = 400
    ) -> list[SkillText]:
        """The top-k of `skills` nearest to `query` (a task instruction), nearest first, each
        kept only if it still fits `token_budget` (estimated with `estimate_tokens`); a skill
        that does not fit is skipped and the next of the top k may still fit."""
        if token_budget <= 0 or k <= 0 or not skills:
            return []
        view = self._view(skills)
        chosen: list[SkillText] = []
        used = 0
        for skill, _ in self._rank(query, view, k):
            t = view.tokens[skill.content_hash]
            if used + t <= token_budget:
                chosen.append(skill)
                used += t
        return chosen

    def for_task(self, query: str, policy: Policy, s: SkillSettings) -> Chosen:
        """The prompt skills and solved tasks a task (its text, `query`) is shown: the `s.k`
        nearest skills within `s.token_budget`, the `s.exemplars` nearest solved tasks within
        `s.exemplar_budget`; None where the policy has none. What a rollout of the loop is
        shown, and so what the gateway shows the same task."""
        skills = exemplars = None
        if policy.skills:
            skills = tuple(self.select(query, policy.skills, s.k, s.token_budget))
        if policy.exemplars:
            exemplars = tuple(self.select(query, policy.exemplars, s.exemplars, s.exemplar_budget))
        return skills, exemplars

    def rank(self, query: str, skills: Sequence[SkillText], k: int) -> list[tuple[SkillText, float]]:
        """The top-k of `skills` with their cosine distance to `query`, nearest first."""
        if not skills or k <= 0:
            return []
        return self._rank(query, self._view(skills), k)

    def _rank(self, query: str, view: _View, k: int) -> list[tuple[SkillText, float]]:
        q = self._query_vector(query)
        scored: dict[str, float] = {}
        if view.ann_ids:
            scored.update(self._search_ann(q, view, k))
        exact_ids, exact_vectors = view.exact
        if exact_ids:
            scored.update(zip(exact_ids, (1.0 - exact_vectors @ q).tolist(), strict=True))
        # Round so that float noise between the two paths cannot reorder equal distances.
        order = sorted(scored, key=lambda i: (round(scored[i], 6), view.by_id[i].name, i))
        return [(view.by_id[i], scored[i]) for i in order[:k]]

    def _search_ann(self, q: np.ndarray, view: _View, k: int) -> dict[str, float]:
        """Nearest members of `view.ann_ids`: ask the index for n hits, keep those in the set;
        too few -> ask for n * 8; beyond `max_ann`, score the whole set exactly from then on."""
        n = max(k * self.overfetch, k)
        while True:
            hits = self.index.nearest(q, n)
            own = {i: d for i, d in hits if i in view.ann_ids}
            if len(own) >= k or (len(hits) < n and len(hits) >= self.index.count()):
                return own  # enough, or the whole index was searched
            if n >= self.max_ann:
                break
            n = min(n * 8, self.max_ann)
        with self._lock:
            if view.ann_ids:  # another thread may have done this already
                ids, vectors = view.exact
                more = sorted(view.ann_ids)
                view.exact = (ids + more, np.concatenate([vectors, self._vectors_for(more, view.by_id)]))
                view.ann_ids = frozenset()
        return {}

    # ---- caches

    def _query_vector(self, query: str) -> np.ndarray:
        """Embedding of a task instruction, cached: both arms of an A/B test, every rollout of
        a task and every generation's evaluation ask with the same instructions."""
        with self._lock:
            v = self._queries.get(query)
            if v is not None:
                self._queries.move_to_end(query)
                return v
        v = embed([query])[0]
        with self._lock:
            self._queries[query] = v
            while len(self._queries) > self._cache_size:
                self._queries.popitem(last=False)
        return v

    def _known_ids(self) -> set[str]:
        if self._known is None:
            self._known = set(self.index.ids())
        return self._known

    def _view(self, skills: Sequence[SkillText]) -> _View:
        snapshot = tuple(skills)
        with self._lock:
            # Tuples of the same objects compare by identity in C: cheap even for 50k skills.
            view = next((v for v in self._views if v.skills == snapshot), None)
            if view is None:
                view = self._build_view(snapshot)
            self._views = [view] + [v for v in self._views if v is not view][:3]
            return view

    def _build_view(self, skills: tuple[SkillText, ...]) -> _View:
        by_id: dict[str, SkillText] = {}
        for s in skills:
            by_id.setdefault(s.content_hash, s)
        known = self._known_ids()
        indexed = [i for i in by_id if i in known]
        ann = frozenset(indexed) if len(indexed) > self.exact_limit else frozenset()
        exact = [i for i in by_id if i not in ann]
        return _View(
            skills=skills,
            by_id=by_id,
            tokens={i: estimate_tokens(skill_document(s)) for i, s in by_id.items()},
            ann_ids=ann,
            exact=(exact, self._vectors_for(exact, by_id)),
        )

    def _vectors_for(self, ids: list[str], skills: dict[str, SkillText]) -> np.ndarray:
        """Embeddings for `ids`, one row each: stored in the index if there, else computed
        (and cached by content hash: an A/B arm's candidate is embedded once)."""
        if not ids:
            return np.empty((0, DIM), dtype=np.float32)
        known = self._known_ids()
        rows = {i: self._vectors[i] for i in ids if i in self._vectors}
        for i in rows:
            self._vectors.move_to_end(i)
        stored = [i for i in ids if i not in rows and i in known]
        if stored:
            try:
                rows.update(zip(stored, self.index.embeddings(stored), strict=True))
            except KeyError:  # deleted behind our back: forget those, embed them below
                known.intersection_update(self.index.ids())
                stored = [i for i in stored if i in known]
                rows.update(zip(stored, self.index.embeddings(stored), strict=True))
        computed = [i for i in ids if i not in rows]
        for i, v in zip(computed, embed([skill_document(skills[i]) for i in computed]), strict=True):
            rows[i] = v
            self._vectors[i] = v
        while len(self._vectors) > self._cache_size:
            self._vectors.popitem(last=False)
        return np.stack([rows[i] for i in ids])
