"""Failure clusters: diagnoses that say the same thing, grouped so each group can yield a guardrail.

Diagnoses are grouped by (family, mode) first: a guardrail is about one kind of mistake
in one kind of task. Given their `FailureKey`s (`diagnosis/keys.py`), also by the tool
called and, for error modes, the error's class; and a failure whose key knows what
successful runs did instead (the tool they called, the arguments it got wrong) joins
only clusters that agree with it, while one with nothing to compare with may join any
cluster of its group. Inside a group, single-pass centroid clustering on the normalized
embeddings of the keys' texts (the summary without the task's own values; without keys,
whatever was embedded, e.g. `Diagnosis.summary()`): cosine >= `similarity` to a cluster's
running mean joins it. The order is by trajectory id, so the same diagnoses give the same
clusters. For the tens to hundreds of failures of a generation this is exact enough and
needs no tuning of a cluster count.

Cluster ids are `<prefix><subset>-<mode>-<n>`, numbered per (family, mode) across its
groups, so a family with one tool numbers its clusters as before keys existed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ratchet.diagnosis.keys import FailureKey, cluster_key
from ratchet.types import Diagnosis, FailureMode, family_of


@dataclass
class FailureCluster:
    id: str
    family: str
    mode: FailureMode
    members: list[Diagnosis]
    key: FailureKey | None = None  # what its members share (`keys.cluster_key`), given keys

    @property
    def size(self) -> int:
        return len(self.members)


def cluster_diagnoses(
    diagnoses: Sequence[Diagnosis],
    embeddings: np.ndarray,
    similarity: float,
    prefix: str = "",
    keys: Sequence[FailureKey] | None = None,
) -> list[FailureCluster]:
    """Clusters, largest first; `embeddings[i]` and `keys[i]` belong to `diagnoses[i]` (unit vectors)."""
    if len(diagnoses) != len(embeddings) or (keys is not None and len(keys) != len(diagnoses)):
        raise ValueError("one embedding (and key) per diagnosis")
    groups: dict[tuple[str, str, tuple[str, ...]], list[int]] = defaultdict(list)
    for i, d in enumerate(diagnoses):
        groups[(family_of(d.task_id), d.mode, keys[i].group if keys else ())].append(i)
    numbered: Counter[tuple[str, str]] = Counter()
    out: list[FailureCluster] = []
    for (family, mode, _), idx in sorted(groups.items()):
        idx.sort(key=lambda i: diagnoses[i].trajectory_id)
        refinements = [keys[i].refinement for i in idx] if keys else [None] * len(idx)
        subset = family.split(":", 1)[-1]
        for m in _centroids(idx, refinements, embeddings, similarity):
            cid = f"{prefix}{subset}-{mode}-{numbered[(family, mode)]}"
            numbered[(family, mode)] += 1
            key = cluster_key([keys[i] for i in m]) if keys else None
            out.append(FailureCluster(cid, family, mode, [diagnoses[i] for i in m], key))  # type: ignore[arg-type]
    out.sort(key=lambda c: (-c.size, c.id))
    return out


def _centroids(
    idx: list[int], refinements: Sequence[object], embeddings: np.ndarray, similarity: float
) -> list[list[int]]:
    """Single-pass centroid clustering; a known refinement only joins a cluster that agrees."""
    sums: list[np.ndarray] = []
    members: list[list[int]] = []
    known: list[object] = []  # each cluster's refinement, None until a member knows one
    for i, r in zip(idx, refinements, strict=True):
        v = embeddings[i]
        best, best_sim = -1, similarity
        for c, total in enumerate(sums):
            if r is not None and known[c] is not None and known[c] != r:
                continue
            sim = float(v @ (total / np.linalg.norm(total)))
            if sim >= best_sim:
                best, best_sim = c, sim
        if best < 0:
            sums.append(v.astype(np.float64).copy())
            members.append([i])
            known.append(r)
        else:
            sums[best] += v
            members[best].append(i)
            known[best] = known[best] if known[best] is not None else r
    return members
