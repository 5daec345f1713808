"""The embedded model server: SmolLM2-135M-Instruct behind an OpenAI-compatible API on 127.0.0.1.

`server.launcher.EmbeddedServer` starts it as a child process and stops it; `ratchet serve`
runs it in the foreground. Any other OpenAI-compatible endpoint can replace it (set
`model.endpoint`).
"""
