"""Failure diagnosis: cheap signals, contrastive attribution, clusters."""
