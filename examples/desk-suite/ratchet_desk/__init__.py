"""ratchet-desk: an example suite plug-in (see README.md)."""
