"""ratchet: make LLM agents improve themselves from their own trajectories, only ever forward.

One import namespace. Each top-level folder of the repository installs as a subpackage
(`flows/` is `ratchet.flows`, `agents/` is `ratchet.agents`, ...). This folder itself is the
bottom layer: shared types, settings, errors and small helpers that import nothing else of
ratchet. The layers, bottom to top (a module imports only from layers below its own):

    ratchet (core) < suites, server, memory, diagnosis < skills < agents < training
        < flows < dashboard < cli

`tests/test_layers.py` enforces it.
"""

__version__ = "0.1.0"
