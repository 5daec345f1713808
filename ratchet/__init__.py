"""ratchet: shared types, settings and errors (the bottom layer), plus the CLI (the top).

Nothing in this package's core modules (`types`, `config`, `errors`, `hashing`) imports
from the rest of the project; `ratchet.cli` is the only module that imports upward.
"""

__version__ = "0.1.0"
