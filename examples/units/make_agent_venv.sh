#!/usr/bin/env bash
# The LangGraph agent's own virtualenv, for langgraph-process.toml: `./make_agent_venv.sh`
# makes agent-venv/ beside this file (or the directory given), from agent-requirements.txt.
# It installs from the package registry: run it once, at install time; ratchet downloads
# nothing when it runs the agent.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
VENV="${1:-agent-venv}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r agent-requirements.txt
"$VENV/bin/python" -c "import langchain_mcp_adapters, langgraph, langchain_openai"
echo "made $VENV: run the agent with $VENV/bin/python langgraph_process.py (langgraph-process.toml)"
