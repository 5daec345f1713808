"""LangGraph agents (`ratchet.agents`): the actor (the policy acting in an episode), the diagnoser,
distiller and toolsmith, the model factory, and the random and gold baselines."""
