"""The intervention endpoint: ratchet in front of the model calls of an agent you already
have (docs/your-agent.md). It records each call as a step of the rollout that made it and
applies the live policy of the arm that rollout plays."""
