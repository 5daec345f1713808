"""The dashboard (`ratchet.dashboard`): server-rendered pages and the HTTP API over the loop's state."""
