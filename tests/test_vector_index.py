"""VectorIndex and MiniLMEmbedding against real Chroma and the real MiniLM model (offline)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ratchet.errors import RatchetError
from ratchet.memory.vector_index import DIM, Hit, MiniLMEmbedding, VectorIndex, embed

ROOT = Path(__file__).resolve().parents[1]

DOCS = {
    "coin": "Pick up every coin you see: when a coin is in the room, take coin before moving on.",
    "door": "Open closed doors before trying to walk through them.",
    "carry": "Add multi-digit numbers column by column and carry the ten to the next column.",
    "calc": "Use the calculator tool for arithmetic instead of computing in your head.",
    "cook": "Read the cookbook, then slice and fry the ingredients the recipe lists.",
    "sort": "Sort objects by weight: weigh each one and put the lightest first.",
}
KINDS = {"coin": "procedure", "door": "guardrail", "carry": "procedure", "calc": "guardrail"}


def _fill(index: VectorIndex) -> None:
    ids = list(DOCS)
    index.upsert(ids, [DOCS[i] for i in ids], [{"kind": KINDS.get(i, "procedure")} for i in ids])


@pytest.fixture
def index(tmp_path: Path) -> VectorIndex:
    ix = VectorIndex(tmp_path / "index", "skills")
    _fill(ix)
    return ix


def test_nearest_neighbour_is_semantic(index: VectorIndex) -> None:
    hits = index.query("grab the gold pieces lying on the floor", k=3)
    assert hits[0].id == "coin"
    assert hits[0].document == DOCS["coin"]
    assert hits[0].metadata == {"kind": "procedure"}
    distances = [h.distance for h in hits]
    assert distances == sorted(distances) and all(0.0 <= d <= 2.0 for d in distances)  # type: ignore[operator]
    assert index.query("what is 348 + 97?", k=1)[0].id in {"carry", "calc"}

    q = embed(["grab the gold pieces lying on the floor"])[0]
    assert index.query_embedding(q, k=3) == hits
    assert index.nearest(q, k=3) == [(h.id, h.distance) for h in hits]
    assert index.nearest(q, k=0) == []


def test_query_size_limits(tmp_path: Path, index: VectorIndex) -> None:
    assert index.query("coin", k=0) == []
    assert len(index.query("coin", k=100)) == len(DOCS)
    empty = VectorIndex(tmp_path / "empty", "skills")
    assert empty.query("coin", k=3) == [] and empty.count() == 0 and empty.ids() == []


def test_where_filters_metadata(index: VectorIndex) -> None:
    hits = index.query("pick up the coin", k=10, where={"kind": "guardrail"})
    assert {h.id for h in hits} == {"door", "calc"}


def test_upsert_is_idempotent_and_replaces(index: VectorIndex) -> None:
    before = index.embeddings(["coin"])
    _fill(index)
    assert index.count() == len(DOCS)
    np.testing.assert_allclose(index.embeddings(["coin"]), before, atol=1e-6)

    index.upsert(["coin"], ["Multiply the two numbers and check the product."], [{"kind": "procedure"}])
    assert index.count() == len(DOCS)
    assert index.get(["coin"])[0].document.startswith("Multiply")
    assert index.query("grab the gold pieces lying on the floor", k=1)[0].id != "coin"


def test_delete(index: VectorIndex) -> None:
    index.delete([])
    assert index.count() == len(DOCS)
    index.delete(["coin", "no-such-id"])
    assert index.count() == len(DOCS) - 1
    assert "coin" not in index.ids()
    assert index.get(["coin"]) == []
    assert all(h.id != "coin" for h in index.query("take the coin", k=10))


def test_get_ids_and_embeddings(index: VectorIndex) -> None:
    assert index.ids() == sorted(DOCS)
    assert [h.id for h in index.get(["sort", "missing", "coin"])] == ["sort", "coin"]
    assert index.get(["sort"])[0] == Hit("sort", DOCS["sort"], {"kind": "procedure"}, None)

    vectors = index.embeddings(["sort", "coin"])
    assert vectors.shape == (2, DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(vectors, embed([DOCS["sort"], DOCS["coin"]]), atol=1e-5)
    assert index.embeddings([]).shape == (0, DIM)
    with pytest.raises(KeyError):
        index.embeddings(["coin", "missing"])


def test_persists_across_processes(index: VectorIndex) -> None:
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from ratchet.memory.vector_index import VectorIndex
        ix = VectorIndex(Path({str(index.path)!r}), "skills")
        hit = ix.query("grab the gold pieces lying on the floor", k=1)[0]
        doc = ix.get(["sort"])[0].document
        print(json.dumps({{"count": ix.count(), "ids": ix.ids(), "top": hit.id, "doc": doc}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"count": len(DOCS), "ids": sorted(DOCS), "top": "coin", "doc": DOCS["sort"]}


def test_embedding_function_round_trips_through_config(index: VectorIndex) -> None:
    from chromadb.utils.embedding_functions import known_embedding_functions

    ef = MiniLMEmbedding()
    config = json.loads(json.dumps(ef.get_config()))
    rebuilt = MiniLMEmbedding.build_from_config(config)
    assert known_embedding_functions[MiniLMEmbedding.name()] is MiniLMEmbedding
    np.testing.assert_allclose(np.array(rebuilt(["a coin"])), np.array(ef(["a coin"])), atol=1e-6)
    with pytest.raises(ValueError):
        MiniLMEmbedding.build_from_config({"model": "some-other-model"})

    # Chroma stored the config with the collection and rebuilds our function from it on open.
    import chromadb
    from chromadb.config import Settings

    client = chromadb.PersistentClient(index.path, settings=Settings(anonymized_telemetry=False))
    stored = client.get_collection("skills").configuration
    assert isinstance(stored["embedding_function"], MiniLMEmbedding)
    assert stored["hnsw"]["space"] == "cosine"  # type: ignore[index]


def test_embed_is_normalized_deterministic_and_restores_torch_threads() -> None:
    import torch

    before = torch.get_num_threads()
    vectors = embed(["take the coin", "add 2 and 3"])
    assert torch.get_num_threads() == before
    assert vectors.shape == (2, DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(embed(["take the coin"])[0], vectors[0])
    assert embed([]).shape == (0, DIM)


def test_open_errors_are_one_line_ratchet_errors(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "chroma.sqlite3").write_bytes(b"not a database" * 100)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for path, name in [(corrupt, "skills"), (a_file, "skills"), (tmp_path / "ok", "x")]:
        with pytest.raises(RatchetError) as info:
            VectorIndex(path, name)
        assert "\n" not in str(info.value) and info.value.fix
