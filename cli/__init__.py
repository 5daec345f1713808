"""The `ratchet` command (Typer + Rich): the top of the layers, importing every other package."""
