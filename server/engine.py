"""Batched generation for the embedded model: one worker thread, static batches, per-row control.

Why our own decode loop instead of `model.generate`: every row of a batch needs its own
grammar (xgrammar matcher — each agent step offers different valid actions), its own
sampling seed and temperature, and its own stop; `generate` takes one of each per call.
The loop is a plain KV-cached decode with left padding, the same math `generate` does.

What it does not do (say so, then nobody is surprised):
* no continuous batching: requests that arrive while a batch runs wait for the next one;
  a batch is formed from whatever is queued when the worker is free (up to `max_batch`);
* rows of one batch share an adapter; requests for different adapters form separate batches;
* seeded sampling is reproducible for the same request in the same batch shape; padding
  in a different batch can change logits in the last float bits and thus, rarely, a sample.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

log = logging.getLogger("ratchet.server")


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    grammar: xgr.CompiledGrammar | None = None
    adapter: str | None = None
    future: Future[GenResult] = field(default_factory=Future)


@dataclass
class GenResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    grammar_complete: bool  # the constrained output is a complete sentence of its grammar


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded (missing, corrupt, wrong base)."""


class Engine:
    """Owns the model. Thread-safe `submit`; generation and adapter changes run on one worker."""

    def __init__(self, model_dir: Path, max_batch: int = 8, batch_wait_s: float = 0.01) -> None:
        self.model_dir = Path(model_dir)
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model: Any = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval()
        self.vocab_size = self.model.config.vocab_size
        self.stop_ids = {self.tokenizer.eos_token_id}
        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(self.stop_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.adapters: dict[str, str] = {}  # name -> path
        self.stats = {"requests": 0, "batches": 0, "largest_batch": 0, "generated_tokens": 0}
        self._queue: queue.Queue[GenRequest] = queue.Queue()
        self._lock = threading.Lock()  # held while the model runs or changes
        self._stopped = threading.Event()
        self._worker = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._worker.start()

    # ----------------------------------------------------------------------------- public
    def submit(self, req: GenRequest) -> Future[GenResult]:
        if req.adapter is not None and req.adapter not in self.adapters:
            raise AdapterError(f"adapter {req.adapter!r} is not loaded")
        self._queue.put(req)
        return req.future

    def generate(self, req: GenRequest) -> GenResult:
        return self.submit(req).result()

    def compile_json_schema(self, schema: str) -> xgr.CompiledGrammar:
        return self.compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def compile_any_json(self) -> xgr.CompiledGrammar:
        return self.compiler.compile_builtin_json_grammar()

    def load_adapter(self, name: str, path: str) -> None:
        from peft import PeftConfig, PeftModel

        p = Path(path)
        if not (p / "adapter_config.json").is_file():
            raise AdapterError(f"{path} is not a LoRA adapter directory (no adapter_config.json)")
        try:
            cfg = PeftConfig.from_pretrained(str(p))
        except Exception as exc:  # noqa: BLE001 - any parse failure means a corrupt adapter
            raise AdapterError(f"cannot read adapter config in {path}: {exc}") from None
        with self._lock:
            if name in self.adapters:
                raise AdapterError(f"adapter {name!r} is already loaded; unload it first")
            try:
                if isinstance(self.model, PeftModel):
                    self.model.load_adapter(str(p), adapter_name=name)
                else:
                    self.model = PeftModel.from_pretrained(self.model, str(p), adapter_name=name)
                self.model.eval()
            except Exception as exc:  # noqa: BLE001
                raise AdapterError(f"cannot load adapter from {path} ({cfg.peft_type}): {exc}") from None
            self.adapters[name] = str(p)

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self.adapters:
                raise AdapterError(f"adapter {name!r} is not loaded")
            self.model.delete_adapter(name)
            del self.adapters[name]

    def close(self) -> None:
        self._stopped.set()
        self._queue.put(None)  # type: ignore[arg-type]
        self._worker.join(timeout=5)

    # ----------------------------------------------------------------------------- worker
    def _loop(self) -> None:
        pending: list[GenRequest] = []
        while not self._stopped.is_set():
            if not pending:
                first = self._queue.get()
                if first is None:
                    return
                pending.append(first)
                # Give concurrent callers a moment to join this batch.
                deadline = time.monotonic() + self.batch_wait_s
                while len(pending) < self.max_batch * 2:
                    timeout = deadline - time.monotonic()
                    try:
                        item = (
                            self._queue.get(timeout=max(timeout, 0))
                            if timeout > 0
                            else self._queue.get_nowait()
                        )
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    pending.append(item)
            else:
                while True:  # drain whatever arrived during the last batch
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    pending.append(item)
            adapter = pending[0].adapter
            batch = [r for r in pending if r.adapter == adapter][: self.max_batch]
            pending = [r for r in pending if r not in batch]
            batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                with self._lock:
                    results = self._generate_batch(batch)
                self.stats["requests"] += len(batch)
                self.stats["batches"] += 1
                self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
                self.stats["generated_tokens"] += sum(len(r.token_ids) for r in results)
                for r, res in zip(batch, results, strict=True):
                    r.future.set_result(res)
            except Exception as exc:  # noqa: BLE001 - report to every caller, keep serving
                log.exception("generation failed")
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)

    @torch.inference_mode()
    def _generate_batch(self, reqs: list[GenRequest]) -> list[GenResult]:
        from contextlib import nullcontext

        model = self.model
        adapter = reqs[0].adapter
        if hasattr(model, "disable_adapter"):
            if adapter is None:
                ctx: Any = model.disable_adapter()
            else:
                model.set_adapter(adapter)
                ctx = nullcontext()
        else:
            ctx = nullcontext()
        with ctx:
            return self._decode(reqs)

    def _decode(self, reqs: list[GenRequest]) -> list[GenResult]:
        n = len(reqs)
        pad = self.tokenizer.pad_token_id
        matchers = [xgr.GrammarMatcher(r.grammar) if r.grammar is not None else None for r in reqs]
        # Jump-forward: text the grammar forces at the start (e.g. '{"name":"act","arguments":{"action":"')
        # is appended to the prompt and prefilled in one pass instead of decoded token by token.
        forced: list[list[int]] = []
        for m in matchers:
            text = m.find_jump_forward_string() if m is not None else ""
            if text:
                m.accept_string(text)
            forced.append(self.tokenizer.encode(text, add_special_tokens=False) if text else [])
        prompts = [r.prompt_ids + f for r, f in zip(reqs, forced, strict=True)]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((n, width), pad, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        positions = (attn.cumsum(-1) - 1).clamp(min=0)

        bitmask = xgr.allocate_token_bitmask(n, self.vocab_size) if any(matchers) else None
        gens = []
        for r in reqs:
            g = torch.Generator()
            g.manual_seed(r.seed if r.seed is not None else torch.seed())
            gens.append(g)

        temps = torch.tensor([max(r.temperature, 1e-5) for r in reqs])
        sampled = any(r.temperature > 0 for r in reqs)
        out_ids: list[list[int]] = [list(f) for f in forced]
        finish: list[str | None] = [None] * n
        complete = [False] * n
        cache = DynamicCache()
        logits = (
            self.model(
                input_ids=input_ids,
                attention_mask=attn,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1, :]
            .float()
        )
        next_pos = positions[:, -1] + 1
        max_new = max(r.max_tokens for r in reqs)
        for _ in range(max_new):
            logits = logits[:, : self.vocab_size]
            if bitmask is not None:
                for i, m in enumerate(matchers):
                    if m is not None and finish[i] is None:
                        m.fill_next_token_bitmask(bitmask, i)
                    else:
                        bitmask[i].fill_(-1)  # all allowed
                xgr.apply_token_bitmask_inplace(logits, bitmask)
            tokens = torch.full((n,), pad, dtype=torch.long)
            greedy = logits.argmax(-1)
            probs = torch.softmax(logits / temps[:, None], dim=-1) if sampled else None
            for i, r in enumerate(reqs):
                if finish[i] is not None:
                    continue
                if r.temperature <= 0 or probs is None:
                    tok = int(greedy[i])
                else:
                    tok = _sample(probs[i], r.top_p, gens[i])
                tokens[i] = tok
                m = matchers[i]
                if m is not None and not m.accept_token(tok):
                    finish[i] = "stop"  # cannot happen with a correct mask; stop rather than emit junk
                    continue
                if tok in self.stop_ids:
                    finish[i] = "stop"
                    complete[i] = m is not None and m.is_terminated()
                    continue
                out_ids[i].append(tok)
                if m is not None and m.is_terminated():
                    finish[i], complete[i] = "stop", True
                elif len(out_ids[i]) - len(forced[i]) >= r.max_tokens:
                    finish[i] = "length"
            if all(f is not None for f in finish):
                break
            attn = torch.cat([attn, torch.ones((n, 1), dtype=torch.long)], dim=1)
            logits = (
                self.model(
                    input_ids=tokens[:, None],
                    attention_mask=attn,
                    position_ids=next_pos[:, None],
                    cache=cache,
                    use_cache=True,
                )
                .logits[:, -1, :]
                .float()
            )
            next_pos = next_pos + 1
        return [
            GenResult(
                token_ids=ids,
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                finish_reason=finish[i] or "length",
                prompt_tokens=len(reqs[i].prompt_ids),
                grammar_complete=complete[i],
            )
            for i, ids in enumerate(out_ids)
        ]


def _sample(probs: torch.Tensor, top_p: float, gen: torch.Generator) -> int:
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
