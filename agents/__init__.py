"""LangGraph agents: the actor (the policy acting in an episode) and the model factory.

Note: `agents` is also the import name of the `openai-agents` package. Don't install both
in one environment; ratchet always imports these modules explicitly (`from agents.actor import ...`).
"""
