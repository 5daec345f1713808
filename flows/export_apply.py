"""Apply a ratchet export to OpenAI chat-completions requests, with Python's standard library only.

Every `ratchet export` holds a copy of this file as `apply.py`, beside the files it reads:
`prompt.json` (the prompt skills and solved examples the policy shows, and what picks them per
task), `tools.json` (the action rules and argument constraints it writes into the tools your
agent offers) and `manifest.json` (the served model). It changes a request body exactly as
ratchet's own `ratchet.skills.calls.apply_request` does for the champion (ratchet's tests hold
the two to the same output on the same bodies):

* the policy's text appended to the first system message (one is added where there is none):
  its prompt skills, then its solved examples;
* each tool whose menu a rule narrows loses those values (a tool left with none is dropped);
  each argument a constraint binds gets an `enum` of what the agent has read so far (the user
  and tool messages), or a length or integer bound;
* `model` set to the policy's served model (the champion adapter's name, vLLM's convention).

Everything else the agent sent is passed on unchanged. Two things it needs from you:

* Per task, ratchet shows only the nearest few prompt skills and solved examples to the task
  (by all-MiniLM-L6-v2 embedding). Pass the task's embedding (`query_vector`, or `--embed` to
  the proxy) for the same choice; without one, every text is shown (`system_addition.md`).
* `no_repeat` rules read what the agent did before in the episode: taken from the assistant
  tool calls in the request's own history, so send the history (most agents do).

Use it three ways: `Export(dir).apply(body, query_vector)` in your code; `python apply.py
apply BODY.json` (the body on stdout); or `python apply.py serve --upstream URL` as a proxy
in front of any OpenAI-compatible server (point your agent's base URL at it).

What the proxy does not do: authenticate callers (it binds 127.0.0.1, adds no key of its own,
and passes on only your agent's Authorization and Content-Type headers), TLS, bodies without a
Content-Length (a chunked upload is refused) or over 16 MiB, or apply anything to routes other
than `/v1/chat/completions` (they are passed through). A client that stalls for 60 s mid-request
is dropped.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import re
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FORMAT = "ratchet-export/1"
HERE = Path(__file__).resolve().parent

Vector = Sequence[float]
Tried = tuple[str, str]  # (the state acted from, the action), both in normal form

# ---------------------------------------------------------------- messages (ratchet.skills.calls)


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def read_so_far(messages: list[dict[str, Any]]) -> list[str]:
    """What the agent has read: the text of every user and tool message, in order."""
    return [text_of(m.get("content")) for m in messages if m.get("role") in ("user", "tool")]


def latest_observation(messages: list[dict[str, Any]]) -> str:
    """The user and tool messages after the last assistant message (all of them at first)."""
    tail: list[str] = []
    for m in reversed(messages):
        if m.get("role") == "assistant":
            break
        if m.get("role") in ("user", "tool"):
            tail.append(text_of(m.get("content")))
    return "\n".join(reversed(tail))


def with_system_text(messages: list[dict[str, Any]], extra: str) -> list[dict[str, Any]]:
    """`extra` appended to the first system (or developer) message, or a system message of
    its own at the front."""
    if not extra:
        return messages
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") in ("system", "developer"):
            m["content"] = f"{text_of(m.get('content'))}\n\n{extra}"
            return out
    return [{"role": "system", "content": extra}, *out]


def tool_specs(tools: list[Any]) -> list[dict[str, Any]] | None:
    """The request's function tools as {name, description, parameters} (None if any is not a
    plain function tool: then the tools are passed on as they are)."""
    specs = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            return None
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            return None
        specs.append(
            {"name": f["name"], "description": str(f.get("description") or ""), "parameters": params}
        )
    return specs


def first_call(message: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """An assistant message's first function call: its name and arguments."""
    for c in message.get("tool_calls") or []:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            continue
        try:
            args = json.loads(f.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            args = {"arguments": f.get("arguments")}
        return f["name"], args if isinstance(args, dict) else {"value": args}
    return None


def tried_in(messages: list[dict[str, Any]]) -> list[Tried]:
    """The episode's earlier (state, action) pairs, from the assistant calls in the history:
    the observation each was made on, and its first tool call."""
    out = []
    for i, m in enumerate(messages):
        if m.get("role") == "assistant" and (call := first_call(m)) is not None:
            out.append((normal(latest_observation(messages[:i])), call_text(*call)))
    return out


# ---------------------------------------------------------------- rules (ratchet.skills.rules)

WILDCARD = "*"
MAX_GRID = 64


def normal(text: Any) -> str:
    """Lowercase, single-spaced: the form patterns and observations are compared in."""
    return " ".join(str(text).lower().split())


def matches(pattern: str, action: str) -> bool:
    return _regex(normal(pattern)).fullmatch(normal(action)) is not None


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern[str]:
    parts = [r"\S+(?: \S+)*" if w == WILDCARD else re.escape(w) for w in pattern.split()]
    return re.compile(" ".join(parts))


def call_text(name: str, args: dict[str, Any]) -> str:
    values = [normal(v) for _, v in sorted(args.items())]
    return f"{name}: {', '.join(values)}" if values else name


def apply_rules(
    rules: Sequence[dict[str, Any]], observation: str, menu: Sequence[str], tried: Sequence[Tried]
) -> tuple[list[str], list[str]]:
    """The menu after the rules (in name order), and the names of the rules that changed it."""
    seen = normal(observation)
    current = list(menu)
    fired: list[str] = []
    for rule in sorted(rules, key=lambda r: r["name"]):
        if not all(normal(w) in seen for w in rule.get("when", ())):
            continue
        kept = [a for a in current if not any(matches(p, a) for p in rule.get("avoid", ()))]
        if rule.get("no_repeat"):
            done = {action for state, action in tried if state == seen}
            kept = [a for a in kept if a not in done]
        preferred = [a for a in kept if any(matches(p, a) for p in rule.get("prefer", ()))]
        if preferred:
            kept = preferred
        if kept and kept != current:
            current = kept
            fired.append(rule["name"])
    return current, fired


def constrain_tools(
    tools: list[dict[str, Any]], rules: Sequence[dict[str, Any]], observation: str, tried: Sequence[Tried]
) -> tuple[list[dict[str, Any]], list[str]]:
    """`tools` after the rules: enumerated parameters narrowed, tools left without an entry
    dropped, every other tool as it was; and the names of the rules that fired."""
    if not rules:
        return list(tools), []
    entries = [_entries(tool) for tool in tools]
    kept, fired = apply_rules(rules, observation, list(dict.fromkeys(e for es in entries for e in es)), tried)
    if not fired:
        return list(tools), []
    keep = set(kept)
    out: list[dict[str, Any]] = []
    for tool, es in zip(tools, entries, strict=True):
        if (grid := _grid(tool)) is not None:
            keys, combos = grid
            left = [c for c, e in zip(combos, es, strict=True) if e in keep]
            if len(left) == len(combos):
                out.append(tool)
            elif left:
                out.append(_narrow_grid(tool, keys, left))
            continue
        key, values = _enum(tool)
        if key is None:
            if es[0] in keep:
                out.append(tool)
            continue
        narrowed = [v for v, e in zip(values, es, strict=True) if e in keep]
        if len(narrowed) == len(values):
            out.append(tool)
        elif narrowed:
            props = dict(tool["parameters"].get("properties", {}))
            props[key] = props[key] | {"enum": narrowed}
            out.append(tool | {"parameters": tool["parameters"] | {"properties": props}})
    return out, fired


def _raw_entries(tool: dict[str, Any]) -> list[str]:
    if (grid := _grid(tool)) is not None:
        return [f"{tool['name']}: {', '.join(str(v) for v in combo)}" for combo in grid[1]]
    key, values = _enum(tool)
    if key is None:
        return [f"{tool['name']}: {WILDCARD}" if tool["parameters"].get("properties") else tool["name"]]
    return [f"{tool['name']}: {v}" for v in values]


def _normal_entry(entry: str) -> str:
    tool, sep, value = entry.partition(": ")
    return f"{normal(tool)}: {normal(value)}" if sep else normal(entry)


def _entries(tool: dict[str, Any]) -> list[str]:
    return [_normal_entry(e) for e in _raw_entries(tool)]


def _enum(tool: dict[str, Any]) -> tuple[str | None, list[Any]]:
    """The tool's one parameter with an enum (the valid actions), if it has exactly one."""
    found = [
        (k, v["enum"])
        for k, v in tool["parameters"].get("properties", {}).items()
        if isinstance(v, dict) and isinstance(v.get("enum"), list)
    ]
    return found[0] if len(found) == 1 else (None, [])


def _grid(tool: dict[str, Any]) -> tuple[tuple[str, ...], list[tuple[Any, ...]]] | None:
    """A tool whose two or more parameters are all required enums: its parameter names
    (sorted) and the combinations it accepts (at most MAX_GRID); None for any other tool."""
    params = tool["parameters"]
    props = params.get("properties") or {}
    keys = tuple(sorted(props))
    if len(keys) < 2 or set(params.get("required") or ()) != set(keys):
        return None
    branches = params.get("anyOf") or [params]
    combos: list[tuple[Any, ...]] = []
    for branch in branches:
        enums = [((branch.get("properties") or {}).get(k) or {}).get("enum") for k in keys]
        if not all(
            isinstance(e, list) and e and all(isinstance(v, str | int | float) for v in e) for e in enums
        ):
            return None
        if len(combos) + math.prod(len(e) for e in enums) > MAX_GRID:
            return None
        combos += itertools.product(*enums)
    return keys, list(dict.fromkeys(combos))


def _narrow_grid(
    tool: dict[str, Any], keys: tuple[str, ...], combos: list[tuple[Any, ...]]
) -> dict[str, Any]:
    props = tool["parameters"].get("properties") or {}
    params = {k: v for k, v in tool["parameters"].items() if k != "anyOf"}
    values = [list(dict.fromkeys(c[i] for c in combos)) for i in range(len(keys))]
    if math.prod(len(v) for v in values) == len(combos):
        params["properties"] = props | {k: props[k] | {"enum": v} for k, v in zip(keys, values, strict=True)}
        return tool | {"parameters": params}
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for combo in combos:
        groups.setdefault(combo[:-1], []).append(combo[-1])
    shape = {k: v for k, v in params.items() if k in ("type", "required", "additionalProperties")}
    params["anyOf"] = [
        shape
        | {
            "properties": {k: props[k] | {"enum": [v]} for k, v in zip(keys, head, strict=False)}
            | {keys[-1]: props[keys[-1]] | {"enum": last}}
        }
        for head, last in groups.items()
    ]
    return tool | {"parameters": params}


# ------------------------------------------------------- constraints (ratchet.skills.constraints)

SPAN_WORDS = 4
ENUM_MAX = 400
_WORD = re.compile(r"[^\W_]+(?:['.\-][^\W_]+)*")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_LIST_MARK = re.compile(r"^\s*(?:\.?\d+[.)]|[-*•])(?=\s|$)\s*")
_SHAPES = {"upper": re.compile(r"[A-Z]+"), "title": re.compile(r"[A-Z][^\s\d]*(?: [A-Z][^\s\d]*)*")}


def spans(texts: Sequence[str], max_words: int = SPAN_WORDS) -> list[str]:
    """Every run of 1..max_words consecutive words of each text, first occurrence first."""
    out: dict[str, None] = {}
    for text in texts:
        for line in re.split(r"[\n,;:!?()\[\]{}\"]+", text):
            words = _WORD.findall(line)
            for i in range(len(words)):
                for n in range(1, max_words + 1):
                    if i + n <= len(words):
                        out.setdefault(" ".join(words[i : i + n]), None)
    return list(out)


def lines(texts: Sequence[str]) -> list[str]:
    """Every non-empty line of each text, its list marker dropped, spaces made single."""
    out: dict[str, None] = {}
    for text in texts:
        for line in text.splitlines():
            if seg := " ".join(_LIST_MARK.sub("", line).split()):
                out.setdefault(seg, None)
    return list(out)


def numbers(texts: Sequence[str]) -> list[float | int]:
    """The numbers written in `texts`, first occurrence first (whole ones as int)."""
    out: dict[float | int, None] = {}
    for text in texts:
        for m in _NUMBER.findall(text):
            v = float(m)
            out.setdefault(int(v) if v.is_integer() else v, None)
    return list(out)


class _Read:
    """What the agent has read, split into spans, lines and numbers once, when first asked."""

    def __init__(self, context: Sequence[str]) -> None:
        self.context = context
        self._cache: dict[str, list[Any]] = {}

    def get(self, what: str) -> list[Any]:
        if what not in self._cache:
            self._cache[what] = {"spans": spans, "lines": lines, "numbers": numbers}[what](self.context)
        return self._cache[what]


def _narrow(prop: dict[str, Any], rule: dict[str, Any], found: _Read) -> dict[str, Any]:
    """One argument's schema under one argument constraint (a copy)."""
    new = dict(prop)
    kind = prop.get("type")
    max_length, min_length = rule.get("max_length"), rule.get("min_length")
    if rule.get("from_context") and kind == "string":
        lo = max(prop.get("minLength", 0), min_length or 0)
        hi = min(prop.get("maxLength", 1 << 30), max_length or 1 << 30)
        shape = _SHAPES.get(rule.get("shape") or "")
        read = found.get("lines" if rule.get("whole_line") else "spans")
        fits = [v for v in read if lo <= len(v) <= hi and (shape is None or shape.fullmatch(v))]
        if 0 < len(fits) <= ENUM_MAX:
            new["enum"] = fits
    elif rule.get("from_context") and kind in ("number", "integer"):
        whole = kind == "integer" or rule.get("integer")
        values = [n for n in found.get("numbers") if not whole or isinstance(n, int)]
        if 0 < len(values) <= ENUM_MAX:
            new["enum"] = values
    if max_length and kind == "string" and max_length < prop.get("maxLength", 1 << 30):
        new["maxLength"] = max_length
    if rule.get("integer") and kind == "number":
        new["type"] = "integer"
    return new


def constrain_args(
    tools: list[dict[str, Any]], constraints: Sequence[dict[str, Any]], context: Sequence[str]
) -> tuple[list[dict[str, Any]], list[str]]:
    """`tools` with each constraint written into the parameters of the tools it names, and the
    names of the constraints that changed one. An argument with an `enum` already is left alone."""
    if not constraints:
        return list(tools), []
    found = _Read(context)
    out: list[dict[str, Any]] = []
    fired: dict[str, None] = {}
    for tool in tools:
        props = dict(tool["parameters"].get("properties") or {})
        changed = False
        for c in sorted(constraints, key=lambda c: c["name"]):
            for arg, rule in c["tools"].get(tool["name"], {}).items():
                prop = props.get(arg)
                if not isinstance(prop, dict) or "enum" in prop:
                    continue
                new = _narrow(prop, rule, found)
                if new != prop:
                    props[arg], changed = new, True
                    fired[c["name"]] = None
        out.append(tool | {"parameters": tool["parameters"] | {"properties": props}} if changed else tool)
    return out, list(fired)


# ------------------------------------------- prompt texts (ratchet.skills.kinds, memory.retrieval)


def render_skills(skills: Sequence[dict[str, Any]]) -> str:
    if not skills:
        return ""
    parts = ["Skills you have learned (follow them when they apply):"]
    parts += [f"## {s['name']}\n{s['description']}\n{s['body'].strip()}" for s in sorted(skills, key=_name)]
    return "\n\n".join(parts)


def render_exemplars(demos: Sequence[dict[str, Any]]) -> str:
    if not demos:
        return ""
    parts = ["Solved examples of similar tasks (the actions that solved them, in order):"]
    parts += [f"Task: {d['description']}\nActions: {'; '.join(d['body'].splitlines())}" for d in demos]
    return "\n\n".join(parts)


def _name(item: dict[str, Any]) -> str:
    return item["name"]


def select(
    query_vector: Vector, items: Sequence[dict[str, Any]], k: int, budget: int
) -> list[dict[str, Any]]:
    """The top-k of `items` nearest to the task's embedding (cosine distance; ties by name,
    then id), nearest first, each kept only while the shown texts fit `budget` tokens."""
    if budget <= 0 or k <= 0 or not items:
        return []
    by_id: dict[str, dict[str, Any]] = {}
    for item in items:
        by_id.setdefault(item["id"], item)
    q = list(query_vector)
    if any(len(item["embedding"]) != len(q) for item in by_id.values()):
        raise ValueError(f"the query vector has {len(q)} numbers, the export's embeddings another count")
    scored = {
        i: 1.0 - math.fsum(a * b for a, b in zip(it["embedding"], q, strict=True)) for i, it in by_id.items()
    }
    order = sorted(scored, key=lambda i: (round(scored[i], 6), by_id[i]["name"], i))[:k]
    chosen, used = [], 0
    for i in order:
        if used + by_id[i]["tokens"] <= budget:
            chosen.append(by_id[i])
            used += by_id[i]["tokens"]
    return chosen


# ---------------------------------------------------------------------------------- the export


class Export:
    """The files of one export, read once."""

    def __init__(self, directory: str | Path = HERE) -> None:
        self.directory = Path(directory)
        self.manifest = self._read("manifest.json")
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.directory} is not a {FORMAT} export (manifest.json says otherwise)")
        self.prompt = self._read("prompt.json")
        self.tools = self._read("tools.json")
        self.model = self.manifest["served_model"]

    def _read(self, name: str) -> dict[str, Any]:
        try:
            return json.loads((self.directory / name).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {self.directory / name}: {exc}") from None

    def shown(self, query_vector: Vector | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The prompt skills and solved examples shown for a task: the nearest few to its
        embedding, as ratchet picks them; every one without it."""
        skills, demos = self.prompt["skills"], self.prompt["exemplars"]
        if query_vector is None:
            return skills, demos
        s = self.prompt["selection"]
        if skills:
            skills = select(query_vector, skills, s["skills_k"], s["skills_token_budget"])
        if demos:
            demos = select(query_vector, demos, s["exemplars_k"], s["exemplars_token_budget"])
        return skills, demos

    def addition(self, query_vector: Vector | None = None) -> str:
        """The text appended to the agent's system message ('' when the policy has none)."""
        skills, demos = self.shown(query_vector)
        return "\n\n".join(x for x in (render_skills(skills), render_exemplars(demos)) if x)

    def apply_request(
        self, body: dict[str, Any], query_vector: Vector | None = None, tried: Sequence[Tried] | None = None
    ) -> tuple[dict[str, Any], list[str]]:
        """`body` as the champion changes it, and the names of the rules and constraints that
        changed its tools. `tried`: the episode's (state, action) pairs, from its history if not given."""
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        tools = body.get("tools")
        specs = tool_specs(tools) if isinstance(tools, list) and tools else None
        narrowed, fired = list(specs or ()), []
        if narrowed:
            tried = tried_in(messages) if tried is None else tried
            narrowed, by_rules = constrain_tools(
                narrowed, self.tools["rules"], latest_observation(messages), tried
            )
            narrowed, by_constraints = constrain_args(
                narrowed, self.tools["constraints"], read_so_far(messages)
            )
            fired = by_rules + by_constraints
        sent = dict(body)
        sent["messages"] = with_system_text(messages, self.addition(query_vector))
        sent["model"] = self.model
        if specs and fired:
            by_name = {t["function"]["name"]: t for t in tools}  # type: ignore[union-attr]
            sent["tools"] = [
                by_name[s["name"]]
                | {"function": by_name[s["name"]]["function"] | {"parameters": s["parameters"]}}
                for s in narrowed
            ]
        return sent, fired

    def apply(self, body: dict[str, Any], query_vector: Vector | None = None) -> dict[str, Any]:
        """`body` as the champion changes it (module docstring)."""
        return self.apply_request(body, query_vector)[0]


def task_query(body: dict[str, Any]) -> str:
    """What picks a task's texts: its first user message (ratchet queries with the task's input)."""
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    return next((text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")


# ---------------------------------------------------------------------------------- the proxy

MAX_BODY = 16 << 20  # bytes of a request body
READ_TIMEOUT_S = 60


def serve(
    export: Export,
    upstream: str,
    host: str = "127.0.0.1",
    port: int = 8001,
    embed: Callable[[str], Vector] | None = None,
    overrides: dict[str, Any] | None = None,
) -> ThreadingHTTPServer:
    """A proxy in front of `upstream` (an OpenAI-compatible base URL, `.../v1`) that applies the
    export to every chat completion (`embed(text)`: the task's embedding, for the per-task
    choice; `overrides`: body keys to set after it, e.g. {"temperature": 0}). Started on a
    thread; `server_address` says where; `shutdown()` stops it."""
    base = upstream.rstrip("/")

    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # a client that stops sending mid-request is dropped

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._forward(None)

        def do_POST(self) -> None:  # noqa: N802
            try:
                size = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                size = -1
            if size < 0 or size > MAX_BODY:
                return self._error(413 if size > 0 else 400, f"Content-Length must be 0 to {MAX_BODY} bytes")
            raw = self.rfile.read(size)
            if not self.path.split("?")[0].rstrip("/").endswith("/chat/completions"):
                return self._forward(raw)
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise ValueError("the body is not a JSON object")
                vector = embed(task_query(body)) if embed is not None else None
                body = export.apply(body, vector) | (overrides or {})
            except Exception as exc:  # noqa: BLE001 - the caller's request: one line back
                return self._error(400, f"{type(exc).__name__}: {exc}")
            self._forward(json.dumps(body).encode())

        def _forward(self, data: bytes | None) -> None:
            path = self.path[3:] if self.path.startswith("/v1/") else self.path
            headers = {
                k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")
            }
            req = urllib.request.Request(base + path, data=data, headers=headers, method=self.command)
            try:
                with urllib.request.urlopen(req, timeout=600) as got:
                    self._relay(got.status, got.headers.get("Content-Type", "application/json"), got)
            except urllib.error.HTTPError as exc:
                self._relay(exc.code, exc.headers.get("Content-Type", "application/json"), exc)
            except (urllib.error.URLError, OSError) as exc:
                self._error(502, f"upstream {base} unreachable: {exc}")

        def _relay(self, status: int, content_type: str, got: Any) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if not content_type.startswith("text/event-stream"):
                data = got.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.end_headers()  # a stream: passed on as it comes, the connection closed at its end
            read = getattr(got, "read1", got.read)
            while chunk := read(1 << 14):
                self.wfile.write(chunk)
                self.wfile.flush()

        def _error(self, status: int, message: str) -> None:
            kind = "server_error" if status >= 500 else "invalid_request_error"
            data = json.dumps({"error": {"message": message, "type": kind}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ratchet-export-proxy", daemon=True).start()
    return server


def load_embed(spec: str) -> Callable[[str], Vector]:
    """`module:function` (importable from the working directory): text -> unit-length vector."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--embed {spec!r}: expected module:function")
    sys.path.insert(0, ".")
    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Apply a ratchet export to chat-completions requests.")
    parser.add_argument("--export", default=str(HERE), help="the export's directory (default: this file's)")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("apply", help="apply to one request body (a JSON file, - for stdin)")
    one.add_argument("body")
    one.add_argument("--query-vector", help="a JSON file with the task's embedding (the per-task choice)")
    proxy = commands.add_parser("serve", help="a proxy that applies it to every chat completion")
    proxy.add_argument(
        "--upstream", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    )
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8001)
    proxy.add_argument("--embed", help="module:function giving a task text's all-MiniLM-L6-v2 embedding")
    proxy.add_argument(
        "--set", action="append", default=[], help="KEY=JSON set on every body (temperature=0)"
    )
    args = parser.parse_args(argv)
    try:
        export = Export(args.export)
        if args.command == "apply":
            text = sys.stdin.read() if args.body == "-" else Path(args.body).read_text(encoding="utf-8")
            vector = json.loads(Path(args.query_vector).read_text()) if args.query_vector else None
            print(json.dumps(export.apply(json.loads(text), vector), indent=2, ensure_ascii=False))
            return 0
        overrides = {k: json.loads(v) for k, _, v in (s.partition("=") for s in args.set)}
        embed = load_embed(args.embed) if args.embed else None
        server = serve(export, args.upstream, args.host, args.port, embed, overrides)
    except (ValueError, OSError, ImportError, AttributeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"applying {export.directory} on http://{host}:{port}/v1 -> {args.upstream} (Ctrl-C to stop)")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
