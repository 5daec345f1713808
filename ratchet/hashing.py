"""Content hashes: policy versions and deterministic ids are derived from content, never counters."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace, so equal content hashes equally."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def content_hash(value: Any, length: int = 16) -> str:
    """Short sha256 hex digest of `value` (str/bytes hashed as is, anything else as canonical JSON)."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode()
    else:
        data = canonical_json(value).encode()
    return hashlib.sha256(data).hexdigest()[:length]
