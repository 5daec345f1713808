"""`python -m ratchet.cli`: the same as the `ratchet` command."""

from ratchet.cli.main import main

main()
