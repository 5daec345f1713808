"""Prefect flows (`ratchet.flows`), one module per stage of the loop (`loop.py` lists them),
plus running the loop (`evolve.py`), the journal, tracking and the runtime they share."""
