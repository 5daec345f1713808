"""The dashboard: an HTTP API over the loop's state (pages come with the evolve issue)."""
