"""A LangGraph agent: `create_react_agent` over two tools, as LangGraph's docs build one.

The model must call a tool each turn (`tool_choice="required"`); `convert` returns directly
(`return_direct=True`), so its result is the graph's last message and the answer.

ratchet calls `build(base_url)` once per task and invokes the graph it returns with
`{"messages": [question]}`; the last message is the answer. The only change ratchet needs is
the chat model's `base_url`. `langgraph_process.py` runs the same graph as a program of its
own, with ratchet's distilled tools loaded over MCP as `more_tools`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from units import UNITS
from units import convert as convert_units

MODEL = os.environ.get("AGENT_MODEL", "smollm2-135m-instruct")
PROMPT = (
    "You answer unit conversion questions. Call the convert tool with the number and the two "
    "units from the question, then reply with the result."
)


@tool(return_direct=True)
def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a quantity from one unit to another."""
    return convert_units(value, from_unit, to_unit)


@tool
def list_units(kind: str) -> str:
    """List the units of one kind: length, mass, time or volume."""
    units = [u for u, (dimension, _) in UNITS.items() if dimension == kind.strip().lower()]
    return ", ".join(units) if units else "kinds: length, mass, time, volume"


def build(base_url: str | None = None, more_tools: Sequence = ()):
    model = ChatOpenAI(
        model=MODEL,
        base_url=base_url,
        api_key=os.environ.get("OPENAI_API_KEY", "not-needed"),
        max_tokens=64,
    )
    tools = [convert, list_units, *more_tools]
    return create_react_agent(model.bind_tools(tools, tool_choice="required"), tools, prompt=PROMPT)


if __name__ == "__main__":
    graph = build(os.environ.get("OPENAI_BASE_URL"))
    print(
        graph.invoke({"messages": [("user", "How many meters are in 3 kilometers?")]})["messages"][-1].content
    )
