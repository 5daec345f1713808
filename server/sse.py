"""A finished chat completion as a server-sent event stream: what OpenAI clients read when they
ask for `stream: true`. Shared by the model server and the intervention endpoint, and kept apart
from the engine so the endpoint (and every command that imports it) does not load torch."""

from __future__ import annotations

import json
from typing import Any


async def sse_chunks(body: dict[str, Any]) -> Any:
    """Stream a finished completion as one delta chunk (enough for clients that ask for SSE)."""
    choice = body["choices"][0]
    delta = dict(choice["message"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(delta["tool_calls"])]
    base = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    yield f"data: {json.dumps(base | {'choices': [{'index': 0, 'delta': delta}]})}\n\n"
    end = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
    yield f"data: {json.dumps(base | {'choices': [end], 'usage': body['usage']})}\n\n"
    yield "data: [DONE]\n\n"
