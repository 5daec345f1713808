"""Failure clusters: diagnoses that say the same thing, grouped so each group can yield a guardrail.

Diagnoses are grouped by (family, mode) first: a guardrail is about one kind of mistake
in one kind of task. Inside a group, single-pass centroid clustering on the normalized
embeddings of `Diagnosis.summary()` (cosine >= `similarity` to a cluster's running mean
joins it); the order is by trajectory id, so the same diagnoses give the same clusters.
For the tens to hundreds of failures of a generation this is exact enough and needs no
tuning of a cluster count.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ratchet.types import Diagnosis, FailureMode, family_of


@dataclass
class FailureCluster:
    id: str
    family: str
    mode: FailureMode
    members: list[Diagnosis]

    @property
    def size(self) -> int:
        return len(self.members)


def cluster_diagnoses(
    diagnoses: Sequence[Diagnosis], embeddings: np.ndarray, similarity: float, prefix: str = ""
) -> list[FailureCluster]:
    """Clusters, largest first; `embeddings[i]` belongs to `diagnoses[i]` (unit vectors)."""
    if len(diagnoses) != len(embeddings):
        raise ValueError("one embedding per diagnosis")
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, d in enumerate(diagnoses):
        groups[(family_of(d.task_id), d.mode)].append(i)
    out: list[FailureCluster] = []
    for (family, mode), idx in sorted(groups.items()):
        idx.sort(key=lambda i: diagnoses[i].trajectory_id)
        sums: list[np.ndarray] = []
        members: list[list[int]] = []
        for i in idx:
            v = embeddings[i]
            best, best_sim = -1, similarity
            for c, total in enumerate(sums):
                sim = float(v @ (total / np.linalg.norm(total)))
                if sim >= best_sim:
                    best, best_sim = c, sim
            if best < 0:
                sums.append(v.astype(np.float64).copy())
                members.append([i])
            else:
                sums[best] += v
                members[best].append(i)
        subset = family.split(":", 1)[-1]
        for c, m in enumerate(members):
            cid = f"{prefix}{subset}-{mode}-{c}"
            out.append(FailureCluster(cid, family, mode, [diagnoses[i] for i in m]))  # type: ignore[arg-type]
    out.sort(key=lambda c: (-c.size, c.id))
    return out
