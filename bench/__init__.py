"""ratchet's benchmarks: `python -m bench` lists them, `python -m bench NAME --help` shows one's
options, `python -m bench NAME [options]` runs it (bench/harness.py; bench/README.md).

Run from the repository root: `bench` is a package of the checkout, not of the installed
`ratchet` (the wheel ships only `ratchet.*`), and `python -m` puts the current directory on
the import path.
"""
