"""The LangGraph agent (`langgraph_agent.py`) as a program of its own, in a virtualenv of its
own (`agent-venv/`, made by `make_agent_venv.sh`): there it loads ratchet's distilled tools with
LangGraph's own MCP adapter, `langchain-mcp-adapters`, which needs mcp 1.x, while ratchet's
FastMCP runs on mcp 2.x. One virtualenv cannot hold both; the MCP protocol is what they share.

ratchet runs it once per task (`langgraph-process.toml`, `agent.kind = "command"`):

* the question comes on stdin, as JSON;
* the model is at `OPENAI_BASE_URL`, the intervention endpoint's base URL for this task;
* with `RATCHET_MCP_URL` set (`agent.mcp = true`), that server's tools are offered beside the
  agent's own. A distilled tool answers the task from its text, so, like `convert`, its result
  is the answer (`return_direct`);
* the answer goes to stdout, and only the answer.

Run it alone against any OpenAI-compatible server:

    echo '"How many meters are in 3 kilometers?"' | OPENAI_BASE_URL=http://127.0.0.1:8000/v1 \\
        agent-venv/bin/python langgraph_process.py
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from langgraph_agent import build


async def mcp_tools(url: str) -> list:
    """The MCP server's tools, as LangChain tools (streamable HTTP)."""
    from langchain_mcp_adapters.client import MultiServerMCPClient  # only where RATCHET_MCP_URL is set

    tools = await MultiServerMCPClient({"ratchet": {"url": url, "transport": "streamable_http"}}).get_tools()
    for t in tools:
        t.return_direct = True
    return tools


async def answer(question: str) -> str:
    url = os.environ.get("RATCHET_MCP_URL")
    graph = build(os.environ.get("OPENAI_BASE_URL"), await mcp_tools(url) if url else [])
    max_steps = int(os.environ.get("RATCHET_MAX_STEPS", "10"))  # a graph step is a model or a tool call
    state = await graph.ainvoke(
        {"messages": [{"role": "user", "content": question}]},
        config={"recursion_limit": 2 * max_steps + 5},
    )
    content = state["messages"][-1].content
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content if isinstance(p, dict))


if __name__ == "__main__":
    task = json.load(sys.stdin)
    print(asyncio.run(answer(task if isinstance(task, str) else json.dumps(task))))
