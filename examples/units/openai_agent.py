"""A plain agent: the `openai` client in a tool-calling loop, as OpenAI's docs write one.

ratchet calls `run(question, base_url, mcp_url=...)` once per task; the only change ratchet
needs is that the client talks to `base_url` (the intervention endpoint). The agent also
offers the model the tools of an MCP server when it is given one (`mcp_url`, with
`agent.mcp = true`): there ratchet serves the tools it distilled. Run it alone against any
OpenAI-compatible server: `OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python openai_agent.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from fastmcp import Client
from openai import OpenAI
from units import convert

MODEL = os.environ.get("AGENT_MODEL", "smollm2-135m-instruct")
SYSTEM = (
    "You answer unit conversion questions. Call the convert tool with the number and the two "
    "units from the question, then reply with the result."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "convert",
            "description": "Convert a quantity from one unit to another.",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number", "description": "the quantity"},
                    "from_unit": {"type": "string", "description": "the unit it is in"},
                    "to_unit": {"type": "string", "description": "the unit asked for"},
                },
                "required": ["value", "from_unit", "to_unit"],
            },
        },
    }
]
MAX_TURNS = 4


def mcp_tools(url: str) -> list[dict]:
    """The MCP server's tools, as OpenAI tools."""

    async def listed() -> list:
        async with Client(url) as mcp:
            return await mcp.list_tools()

    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in asyncio.run(listed())
    ]


def call_mcp(url: str, name: str, args: dict) -> str:
    async def called() -> str:
        async with Client(url) as mcp:
            result = await mcp.call_tool(name, args, raise_on_error=False)
        text = " ".join(getattr(c, "text", "") for c in result.content)
        return f"error: {text}" if result.is_error else text

    return asyncio.run(called())


def run(question: str, base_url: str | None = None, mcp_url: str | None = None) -> str:
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "not-needed"))
    tools = TOOLS + (mcp_tools(mcp_url) if mcp_url else [])
    served = {t["function"]["name"] for t in tools[len(TOOLS) :]}
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    last_result = ""
    for turn in range(MAX_TURNS):
        response = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=tools,
            tool_choice="required" if turn == 0 else "auto",
            max_tokens=64,
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return message.content or last_result
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                if call.function.name in served:
                    last_result = call_mcp(mcp_url, call.function.name, args)
                else:
                    last_result = convert(args["value"], args["from_unit"], args["to_unit"])
            except (ValueError, KeyError, TypeError) as exc:
                last_result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": last_result})
    return last_result


if __name__ == "__main__":
    print(run(" ".join(sys.argv[1:]) or "How many meters are in 3 kilometers?"))
