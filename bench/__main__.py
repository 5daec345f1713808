"""`python -m bench [NAME [options]]` (run from the repository root): bench/harness.py:main."""

from bench.harness import main

raise SystemExit(main())
