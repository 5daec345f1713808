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

from server.prefix_cache import PrefixCache

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
    ignore_eos: bool = False  # benchmarks: always generate max_tokens (vLLM's extension of the same name)
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

    def __init__(
        self,
        model_dir: Path,
        max_batch: int = 8,
        batch_wait_s: float = 0.01,
        prefix_cache_tokens: int = 32_768,
    ) -> None:
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
        self.stats = {
            "requests": 0,
            "batches": 0,
            "largest_batch": 0,
            "generated_tokens": 0,
            "prompt_tokens": 0,
            "prefilled_tokens": 0,
        }
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
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
            self.prefix_cache.drop_adapter(name)

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

    def _prefill(
        self, prompts: list[list[int]], adapter: str | None
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batched forward over what the prefix cache does not already hold.

        Row i is laid out as [pad | cached prefix (m_i) | pad | new tokens (s_i)] — holes are
        masked out, positions are explicit — so hits and misses share one forward pass.
        Returns the batch cache, its attention mask, each row's next position and last logits.
        """
        n = len(prompts)
        hits = [self.prefix_cache.lookup(adapter, p) for p in prompts]
        past = max(m for m, _ in hits)
        width = max(len(p) - m for p, (m, _) in zip(prompts, hits, strict=True))
        cache = DynamicCache()
        attn = torch.zeros((n, past + width), dtype=torch.long)
        if past:
            layers = len(next(kv for _, kv in hits if kv is not None))
            ref_k, ref_v = next(kv for _, kv in hits if kv is not None)[0]
            for layer in range(layers):
                keys = ref_k.new_zeros((n, ref_k.shape[1], past, ref_k.shape[3]))
                values = ref_v.new_zeros((n, ref_v.shape[1], past, ref_v.shape[3]))
                for i, (m, kv) in enumerate(hits):
                    if kv is not None:
                        keys[i, :, past - m :] = kv[layer][0][0]
                        values[i, :, past - m :] = kv[layer][1][0]
                cache.update(keys, values, layer)
        input_ids = torch.full((n, width), self.tokenizer.pad_token_id, dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        for i, (p, (m, _)) in enumerate(zip(prompts, hits, strict=True)):
            new = p[m:]
            attn[i, past - m : past] = 1
            attn[i, past + width - len(new) :] = 1
            input_ids[i, width - len(new) :] = torch.tensor(new)
            positions[i, width - len(new) :] = torch.arange(m, len(p))
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
        for i, (p, (m, _)) in enumerate(zip(prompts, hits, strict=True)):
            cols = torch.cat(
                [torch.arange(past - m, past), torch.arange(past + width - (len(p) - m), past + width)]
            )
            kv = [
                (lay.keys[i : i + 1, :, cols].clone(), lay.values[i : i + 1, :, cols].clone())
                for lay in cache.layers
            ]
            self.prefix_cache.store(adapter, p, kv)
        self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
        self.stats["prefilled_tokens"] += sum(len(p) - m for p, (m, _) in zip(prompts, hits, strict=True))
        next_pos = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return cache, attn, next_pos, logits

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
        cache, attn, next_pos, logits = self._prefill(prompts, reqs[0].adapter)

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
                if tok in self.stop_ids and not (r.ignore_eos and m is None):
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
