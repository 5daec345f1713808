"""The gateway: a standing OpenAI-compatible server that applies the live champion to every call
of a user's agent, names the policy version on every answer, and swaps to a new version on
promotion or rollback without a restart (`ratchet gateway`)."""
