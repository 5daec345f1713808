"""Prefect flows, one module per stage of the loop (explore, evaluate, generation, ...)."""
