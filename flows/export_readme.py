"""README.md of a `ratchet export` (`flows/export.py`): what each file is and how to use it,
written from the export's manifest so it names this champion's own parts."""

from __future__ import annotations

from typing import Any


def render(m: dict[str, Any]) -> str:
    """The README for the export described by manifest `m` (its `files` not needed)."""
    counts = m["counts"]
    adapter = next((c for c in m["candidates"] if c["kind"] == "adapter"), None)
    parts = [_head(m), _files(m, adapter), _use(m), _prompt(m), _tools(counts)]
    if adapter is not None:
        parts.append(_adapter(m, adapter))
    if m["mcp"] is not None:
        parts.append(_mcp(m["mcp"]))
    parts.append(_manifest())
    return "\n\n".join(parts) + "\n"


def _head(m: dict[str, Any]) -> str:
    lines = [
        f"# Champion policy {m['policy_version']} of evolution `{m['evolution']}`",
        "",
        f"Exported by ratchet {m['provenance']['ratchet_version']} on {m['provenance']['exported_at']}. "
        f"Model: `{m['model']}`"
        + (
            f", served as `{m['served_model']}` (the LoRA adapter's name)."
            if m["served_model"] != m["model"]
            else "."
        ),
        "",
        "These files are what the champion changes in your agent's model calls, as plain data, "
        "and `apply.py`, a standard-library-only script that applies them to an OpenAI "
        "chat-completions request exactly as ratchet's gateway and intervention endpoint do. "
        "Nothing here needs ratchet, except serving the distilled MCP tools (below).",
        "",
        "| candidate | kind | gate | promoted |",
        "| --- | --- | --- | --- |",
    ]
    for c in m["candidates"]:
        g = c.get("gate") or {}
        gate = (
            f"+{g.get('repairs')} −{g.get('regressions')}, p = {_p(g.get('p_value'))}" if g else "not gated"
        )
        when = (
            f"{(c.get('promoted_at') or '')[:19]} by {c.get('promoted_by')}" if c.get("promoted_at") else "-"
        )
        lines.append(f"| `{c['name']}` | {c['kind']} | {gate} | {when} |")
    return "\n".join(lines)


def _p(p: Any) -> str:
    return f"{p:.3g}" if isinstance(p, int | float) else str(p)


def _files(m: dict[str, Any], adapter: dict[str, Any] | None) -> str:
    rows = [
        (
            "manifest.json",
            "what this is: policy version, model, every candidate with its gate evidence "
            "and who promoted it when, provenance, and the sha256 of every other file",
        ),
        (
            "system_addition.md",
            "the text the champion appends to your agent's system message, with every "
            "prompt skill and solved example (per task, ratchet shows only the nearest few: see below)",
        ),
        (
            "prompt.json",
            "those texts one by one, each with the embedding and token count that pick it "
            "for a task, and the selection's settings",
        ),
        (
            "tools.json",
            "how the champion changes the tools your agent offers: action rules (menu values "
            "removed or preferred) and argument constraints (an argument must be what the agent has read)",
        ),
        (
            "apply.py",
            "applies all of the above to a request body: in your code, on the command line, or "
            "as a proxy in front of any OpenAI-compatible server",
        ),
    ]
    if adapter is not None:
        rows.append(
            (
                "adapter/",
                "the champion LoRA adapter, a peft folder (`adapter_config.json`, "
                "`adapter_model.safetensors`)",
            )
        )
    if m["mcp"] is not None:
        rows.append(("tools/", "the promoted MCP tools, as skill folders (SKILL.md, scripts/tool.py)"))
        rows.append(("mcp.json", "an MCP client's server entry that serves them"))
    return "## Files\n\n| file | what it is |\n| --- | --- |\n" + "\n".join(
        f"| `{f}` | {w} |" for f, w in rows
    )


def _use(m: dict[str, Any]) -> str:
    return f"""## Use it

As a proxy (no change to your agent but its base URL):

```bash
python apply.py serve --upstream http://127.0.0.1:8000/v1 --port 8001 --set temperature=0
OPENAI_BASE_URL=http://127.0.0.1:8001/v1 python your_agent.py
```

`--upstream` is your model server's base URL; the proxy applies the champion to every
`/v1/chat/completions` body and passes everything else through (your agent's `Authorization`
header included; it adds no key of its own and listens on 127.0.0.1). `--set KEY=JSON` sets a
body key after the champion (greedy decoding for an evaluation: `temperature=0`). Streams are
passed on as they come.

In your code:

```python
from apply import Export

export = Export("path/to/this/folder")
body = export.apply(body, query_vector=embedding_of_the_task)  # or query_vector=None
```

One body on the command line: `python apply.py apply body.json > applied.json`.

The body's `model` becomes `{m["served_model"]}`: serve the model (and adapter) under that
name, or change it after applying."""


def _prompt(m: dict[str, Any]) -> str:
    s = m["exemplar_selection"]
    return f"""## The system-message addition, and the per-task choice

The champion shows its prompt skills and solved examples (exemplars) in the system message. Per
task, ratchet shows only the {s["skills_k"]} prompt skills nearest to the task (within
{s["skills_token_budget"]} tokens) and the {s["exemplars_k"]} nearest solved examples (within
{s["exemplars_token_budget"]} tokens), nearest first; "nearest" is the cosine distance between
all-MiniLM-L6-v2 embeddings (normalized) of the task's input and of each text
(`name\\ndescription\\nbody`).

Decision: `prompt.json` holds every text with the exact embedding ratchet ranks it by, so
`apply.py` reproduces ratchet's choice when you give it the task's embedding:

```python
from sentence_transformers import SentenceTransformer
model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
def embed(text):  # the task's input: your agent's first user message
    return model.encode(text, normalize_embeddings=True).tolist()
```

(`python apply.py serve ... --embed mymodule:embed` does this for every request, with the first
user message as the task.) Without an embedding, `apply.py` shows every text, which is
`system_addition.md`: what ratchet itself shows where it has no retriever. The two can score
differently; measure on your own tasks (ratchet's `bench/export_roundtrip.py` does on its
units example)."""


def _tools(counts: dict[str, int]) -> str:
    return f"""## Tool-schema changes (`tools.json`)

{counts["rules"]} action rule(s) and {counts["constraints"]} argument constraint(s). Both are
data that `apply.py` writes into the tools your agent offers before each call, so a server with
constrained decoding (vLLM, llama.cpp, ratchet's own) can only produce what they allow:

* a **rule** acts on a tool whose parameter is an enum (a menu of valid actions): when its
  `when` phrases are all in the latest observation it removes the values matching `avoid`,
  with `no_repeat` those already taken from this same observation (read from your request's
  own history of assistant tool calls), and keeps only those matching `prefer` if any do;
* an **argument constraint** is dynamic: `from_context` makes the argument an `enum` of what
  the agent has read so far (spans of up to four words, or whole lines, of the user and tool
  messages; for a number, the numbers written there), recomputed on every call; `max_length`,
  `min_length`, `shape` and `integer` bound it further.

`tools.json`'s `how` says the same in two lines."""


def _adapter(m: dict[str, Any], a: dict[str, Any]) -> str:
    name = a["served_name"]
    base = a.get("base_model") or m["model"]
    rank = f" --max-lora-rank {a['rank']}" if isinstance(a.get("rank"), int) and a["rank"] > 16 else ""
    return f"""## The LoRA adapter (`adapter/`)

A peft folder (sha256 of its files, in the manifest: `{a["content_hash"][:16]}…`), trained on
`{m["model"]}` (its config names `{base}`). Serve it under the name the body's `model` asks
for, `{name}`:

vLLM:

```bash
vllm serve <base model: the Hugging Face copy of {m["model"]}> \\
  --enable-lora --lora-modules {name}=$PWD/adapter{rank}
```

llama.cpp: convert it to GGUF with llama.cpp's own script, then load it beside the base model's
GGUF (llama-server applies it to every request, whatever `model` says):

```bash
python convert_lora_to_gguf.py adapter --base <the base model's Hugging Face folder> \\
  --outfile {name}.gguf
llama-server -m <base model>.gguf --lora {name}.gguf
```"""


def _mcp(mcp: dict[str, Any]) -> str:
    command = " ".join([mcp["command"], *mcp["args"]])
    return f"""## The MCP tools (`tools/`, `mcp.json`)

```bash
{command}
```

serves them over MCP on stdio (`mcp.json` is the entry an MCP client's configuration takes;
add `--transport http --port 8765` for HTTP on 127.0.0.1). Why ratchet and not a script:
{mcp["why"]}. Each tool is checked against its own content hash and this manifest's before it
is served. If you move this folder, change the path in the command."""


def _manifest() -> str:
    return """## The manifest

`manifest.json` names the policy version (the content hash ratchet's gateway puts on every
answer), the evolution and the model; for each candidate its kind, name, content hash, the
gate's evidence (repairs, regressions, exact p-value, tasks, rollouts, the champion it was
tested against), when and by whom it was promoted (the audit log), and where it came from (the
train trajectories it was distilled from, or the adapter's MLflow run); and the sha256 of every
other file here, so a copy can be checked: `sha256sum` each and compare."""
