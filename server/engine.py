"""Batched generation for the embedded model: one worker thread, continuous batching.

Why our own decode loop instead of `model.generate`: every row of a batch needs its own
grammar (xgrammar matcher — each agent step offers different valid actions), its own
sampling seed and temperature, and its own stop; `generate` takes one of each per call.
The loop is a plain KV-cached decode over left-padded rows, the same math `generate` does:
new requests are prefilled and merged into the running batch between decode steps, and a
row is answered as soon as it stops. Prompt prefixes seen before are not prefilled again
(`server.prefix_cache`). Requests admitted together are prefilled in groups of similar
new-token counts (`prefill_groups`): one padded forward costs every row the longest row's
width, and an agent's step (tens of new tokens after its cached prefix) that lands beside a
fresh prompt (hundreds) would otherwise pay for the fresh one. A prefill wider than
`PREFILL_CHUNK` query tokens runs in chunks of columns, each a forward over the cache the
ones before it filled: the same attention for every token, and what one forward allocates
beside the cache is bounded by the chunk instead of the prompt (`prefill_chunks`).

Constrained replies are not decoded where the grammar decides them: the text it forces at
the start (`{"name":"act","arguments":{"action":"`) is prefilled with the prompt, and once a
reply's rest is forced to its stop token (an action whose first tokens already tell it from
the others, then `"}}`) the row is answered without decoding it (`_forced_end`). An agent
step then costs one prefill and, when two valid actions share their first tokens, a forward
or two; the reply is the one decoding every token would give (bench/results/forced_end.json).

Keys and values live in one pool shared by the running batch and the prefix cache
(`server.kv_pool`): a token's are written once, into a slot, when it is prefilled or
decoded; a batch is a table of slot numbers and the model reads it through `PagedCache`
(`server.kv_cache`), one layer at a time. Admitting a cached prompt, merging new rows into
the batch and dropping finished ones move slot numbers, never keys and values. A finished
row stays in the table until the next admission (or until `compact_share` of the rows are
finished), fed padding whose keys and values go to a scratch slot. The worker clocks its time
by part in `stats` (`bench/profile_generation.py` reads them through `/health`).

What it does not do (say so, then nobody is surprised):
* rows of one batch share an adapter; requests for another adapter wait until it drains;
* seeded sampling is reproducible for the same request computed the same way: the same
  batch shape and the same prefix-cache state. Padding in another batch, or a prompt whose
  prefix is cached (its last tokens fed over stored keys instead of with the rest), changes
  logits in the last bits, which in bfloat16 often flips a sample: on the shipped model a
  cold request and the same request again (a cache hit) differed within 24 sampled tokens
  for 6 of 20 seeds in bf16, 0 of 20 in fp32 (`python -m bench seeded_replies`).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

from ratchet.server import attention, prefix_cache
from ratchet.server.kv_cache import PagedCache
from ratchet.server.kv_pool import PAD, RESERVED, SCRATCH, KVPool, slot_bytes
from ratchet.server.memory import release_free_memory
from ratchet.server.prefix_cache import PrefixCache
from ratchet.server.schema_bounds import bound_patterns

log = logging.getLogger("ratchet.server")

RELEASE_IDLE_S = 0.5  # longer than the gap between an agent's steps, shorter than a stage change
# A prefill's forward takes at most this many query tokens (rows x columns); a longer prefill
# runs in chunks of columns, each attending to the cache the earlier ones filled. What a forward
# allocates beside the cache (attention masks over every key, MLP activations) grows with its
# query tokens: a cold batch of 8 prompts of 2,000 tokens held ~0.45 GB of it in one forward.
# 1,024 rather than 2,048: 122 MiB off the server's peak during the README's run in bf16, in
# the same time (bench/RESULTS.md, "the server under 1.5 GB").
PREFILL_CHUNK = 1024
# In bf16, a prefill's query columns and cached columns are each padded up to one of this many
# sizes per power of two (`shape_bucket`). bf16 matmuls and attention on CPU keep kernels and
# packed operands per distinct shape, and leave the heap in holes sized by it: during the
# README's run, a server that prefilled every width exactly grew ~0.5 GB more. fp32 keeps
# nothing per shape, and the padding would only cost time there (bench/RESULTS.md, "shape
# buckets").
SHAPE_BUCKETS = 4
# Keys and values are stored in 16 bits under an fp32 model: 23 KB a token instead of 46 KB,
# so the pool's budget holds as many tokens as in bf16. fp16, not bf16: three more bits of
# mantissa, and the shipped model's keys and values stay under 25 in magnitude (fp16 reaches
# 65,504). Each is rounded once, when written; attention computes in fp32 as before.
KV_DTYPES = {torch.float32: torch.float16}


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
        prefix_cache_bytes: int = prefix_cache.DEFAULT_BYTES,
        group_prefill: bool = True,
        compact_share: float = 0.5,
        forced_end: bool = True,
        attn_implementation: str = attention.NAME,
        dtype: torch.dtype = torch.float32,
        release_idle_s: float | None = RELEASE_IDLE_S,
        prefill_chunk: int = PREFILL_CHUNK,
        shape_buckets: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.dtype = dtype  # bf16 where the CPU multiplies it natively (`server.precision`)
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        # False: one padded forward for all (bench/results/prefill_groups.json)
        self.group_prefill = group_prefill
        # finished rows ride along until the next admission, or until they are this share of
        # the batch (0: dropped at once). It saved a copy of the batch when rows had buffers
        # of their own (bench/results/kv_append.json); in the pool, dropping a row copies nothing
        self.compact_share = compact_share
        # a reply whose grammar forces its rest is finished without decoding it (`_forced_end`;
        # False: decoded token by token, as before; bench/results/forced_end.json)
        self.forced_end = forced_end
        # idle this long after work: freed memory goes back to the OS (`server.memory`); None: never
        self.release_idle_s = release_idle_s
        # query tokens per prefill forward (`PREFILL_CHUNK`); 0: every prefill in one forward
        self.prefill_chunk = prefill_chunk
        # prefill shapes padded to `shape_bucket`s (0: exact widths); None: in bf16 only
        if shape_buckets is None:
            shape_buckets = SHAPE_BUCKETS if dtype == torch.bfloat16 else 0
        self.shape_buckets = shape_buckets
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # grouped-query attention without copying keys and values per query head
        # (`server.attention`; "sdpa" is transformers' own, bench/results/grouped_attention.json)
        self.attn_implementation = attn_implementation
        self.model: Any = self._load_base()
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
            "forward_steps": 0,
            "largest_batch": 0,
            "generated_tokens": 0,
            "forced_end_tokens": 0,  # tokens appended by `_forced_end` instead of decoded
            "forced_ends": 0,  # replies finished that way
            "memory_releases": 0,  # idle pauses that gave freed memory back (`_next_request`)
            "prompt_tokens": 0,
            "prefilled_tokens": 0,
            "prefill_slots": 0,  # rows x width of every prefill forward: prefilled tokens plus padding
            # query x key pairs attention computed, and those a row's own tokens needed (the rest
            # is padding: rows of one batch share the widest row's columns)
            "attended_pairs": 0,
            "attended_needed": 0,
            # where the worker's time goes (bench/profile_generation.py): the model's forwards,
            # grammar masks and matching, and KV bookkeeping (prefix cache, merging rows in and out)
            "busy_seconds": 0.0,
            "prefill_seconds": 0.0,
            "decode_seconds": 0.0,
            "grammar_seconds": 0.0,
            "kv_seconds": 0.0,
            "in_flight": 0,  # requests submitted and not yet answered (or cancelled)
        }
        self._count_lock = threading.Lock()
        # keys and values of running requests and cached prompts, in one pool (`server.kv_pool`):
        # it starts with room for `prefix_cache_bytes` and grows only when running requests
        # alone need more; cached prompts are given back to make room
        cfg = self.model.config
        heads = cfg.num_key_value_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # stored in `kv_dtype` (None: `KV_DTYPES`, else the model's own), computed with in the model's
        self.kv_dtype = kv_dtype or KV_DTYPES.get(dtype, dtype)
        shape = (cfg.num_hidden_layers, heads, dim, self.kv_dtype)
        self.pool = KVPool(*shape, capacity=prefix_cache_bytes // slot_bytes(*shape), compute_dtype=dtype)
        self.prefix_cache = PrefixCache(self.pool, enabled=prefix_cache_bytes > 0)
        self._queue: queue.Queue[GenRequest] = queue.Queue()
        self._lock = threading.Lock()  # held while the model runs or changes
        self._stopped = threading.Event()
        self._stop_reason = "engine is closed"
        self._worker = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._worker.start()

    def _load_base(self) -> Any:
        return AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=self.dtype, attn_implementation=self.attn_implementation
        )

    # ----------------------------------------------------------------------------- public
    def submit(self, req: GenRequest) -> Future[GenResult]:
        if self._stopped.is_set():
            raise RuntimeError(self._stop_reason)
        if req.adapter is not None and req.adapter not in self.adapters:
            raise AdapterError(f"adapter {req.adapter!r} is not loaded")
        with self._count_lock:
            self.stats["in_flight"] += 1
        req.future.add_done_callback(self._answered)
        self._queue.put(req)
        if self._stopped.is_set():  # it stopped as this came in: the worker may not see it
            _refuse(req, RuntimeError(self._stop_reason))
        return req.future

    def _answered(self, _: Future[GenResult]) -> None:
        with self._count_lock:
            self.stats["in_flight"] -= 1

    def generate(self, req: GenRequest) -> GenResult:
        return self.submit(req).result()

    def compile_json_schema(self, schema: str) -> xgr.CompiledGrammar:
        return compile_json_schema(self.compiler, schema)

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
            except Exception as exc:  # noqa: BLE001 - corrupt weights, wrong base, ...: undo, then report
                self._undo_failed_load(name)
                raise AdapterError(f"cannot load adapter from {path} ({cfg.peft_type}): {exc}") from None
            self.adapters[name] = str(p)

    def _undo_failed_load(self, name: str) -> None:
        """A half-loaded adapter must not change what the base model or other adapters say."""
        peft_config = getattr(self.model, "peft_config", {})
        if self.adapters and name in peft_config:
            self.model.delete_adapter(name)
        elif not self.adapters:  # the failed first load may have injected LoRA layers in place
            self.model = self._load_base().eval()
            self.prefix_cache.clear()

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if name not in self.adapters:
                raise AdapterError(f"adapter {name!r} is not loaded")
            self.model.delete_adapter(name)
            del self.adapters[name]
            self.prefix_cache.drop_adapter(name)
            if not self.adapters:  # peft cannot disable a deleted adapter: go back to the bare base model
                self.model = self.model.unload()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (rows in flight keep their own slots). Only speed changes,
        and the order in which later prompts are split between cache and prefill: two runs
        that each start from an empty cache compute the same sums in the same order."""
        with self._lock:
            self.prefix_cache.clear()

    def close(self) -> None:
        self._stopped.set()
        self._queue.put(None)  # type: ignore[arg-type]
        self._worker.join(timeout=5)

    # ----------------------------------------------------------------------------- worker
    def _loop(self) -> None:
        """Continuous batching: new requests join the running batch between decode steps,
        and each row is answered the moment it finishes."""
        work = _Work()
        try:
            self._serve(work)
        except BaseException as exc:  # a bug in the loop itself: nobody may wait forever
            log.exception("the engine's worker stopped")
            self._stop_reason = f"the model server's engine stopped ({type(exc).__name__}: {exc}); restart it"
            self._stopped.set()
            stopped = RuntimeError(self._stop_reason)
            self._fail(work.batch, work.pending, stopped)
            while True:
                try:
                    req = self._queue.get_nowait()
                except queue.Empty:
                    break
                if req is not None:
                    _refuse(req, stopped)

    def _serve(self, work: _Work) -> None:
        pending = work.pending
        worked = False  # since memory was last given back
        while True:
            try:
                if work.batch is None and not pending:
                    item = self._next_request(worked)
                    worked = True
                    if item is None:
                        return
                    pending.append(item)
                    time.sleep(self.batch_wait_s)  # let callers that came together start together
                while True:
                    item = self._queue.get_nowait()
                    if item is None:
                        self._fail(work.batch, pending, RuntimeError("engine closed"))
                        return
                    pending.append(item)
            except queue.Empty:
                pass
            with self._lock, self._clock("busy_seconds"):
                try:
                    work.batch = self._admit(work.batch, pending)
                    if work.batch is not None:
                        work.batch = self._step(work.batch)
                except Exception as exc:  # noqa: BLE001 - report to every caller, keep serving
                    log.exception("generation failed")
                    self._fail_batch(work.batch, exc)
                    work.batch = None

    def _next_request(self, worked: bool) -> GenRequest | None:
        """Wait for a request; after work, a pause of `release_idle_s` first gives the freed
        memory of the last batches back (a busy batch never waits here)."""
        if worked and self.release_idle_s is not None:
            try:
                return self._queue.get(timeout=self.release_idle_s)
            except queue.Empty:
                with self._lock:
                    release_free_memory()
                    self.stats["memory_releases"] += 1
        return self._queue.get()

    @staticmethod
    def _fail(batch: _Batch | None, pending: deque[GenRequest], exc: BaseException) -> None:
        for req in [*(row.req for row in (batch.rows if batch else [])), *pending]:
            if not req.future.done():
                req.future.set_exception(exc)

    def _fail_batch(self, batch: _Batch | None, exc: BaseException, running: _Batch | None = None) -> None:
        """A batch that failed: its rows get `exc` and its slots go back (`running`: the batch
        that goes on, if this one had not joined it yet)."""
        self._fail(batch, deque(), exc)
        try:
            self._drop(batch)
        except Exception:  # noqa: BLE001 - a bookkeeping bug must not stop the server
            log.exception("a failed batch could not give its key-value slots back")
        self._recount_slots(running)

    def _recount_slots(self, running: _Batch | None) -> None:
        """After a failure, every hold on a slot must be the running batch's or the prefix
        cache's (one per token it stores). If a cleanup failed on the way, they are not, and
        cannot be trusted: the prefix cache starts empty and only `running` holds slots."""
        want = self.prefix_cache.cached_tokens
        if running is not None:
            want += int((running.slots >= RESERVED).sum())
        if int(self.pool.refs[RESERVED:].sum()) == want:
            return
        log.error("the key-value slots' counts were wrong after a failure; the prefix cache starts over")
        self.prefix_cache.forget()
        self.pool.reset()
        if running is not None:
            self.pool.hold(running.slots)

    def _drop(self, batch: _Batch | None) -> None:
        """A batch that ends gives its rows' slots back (the prefix cache may still hold them)."""
        if batch is not None:
            self.pool.release(batch.slots)
            batch.slots = batch.slots[:, :0]

    def _admit(self, batch: _Batch | None, pending: deque[GenRequest]) -> _Batch | None:
        """Move waiting requests for the batch's adapter into it (prefilled), up to max_batch."""
        room = self.max_batch - (sum(row.finish is None for row in batch.rows) if batch else 0)
        if room <= 0 or not pending:
            return batch
        adapter = pending[0].adapter
        if batch is not None and adapter != batch.adapter:
            return batch  # the oldest waiting request needs another adapter: let this batch drain
        take: list[GenRequest] = []
        for req in list(pending):
            if len(take) == room:
                break
            if req.adapter == adapter:
                pending.remove(req)
                if req.future.set_running_or_notify_cancel():
                    take.append(req)
        if not take:
            return batch
        try:
            new = self._start(take, adapter)
        except Exception as exc:  # noqa: BLE001 - e.g. an adapter unloaded while its request waited
            log.exception("prefill failed")
            for req in take:
                req.future.set_exception(exc)
            self._recount_slots(batch)
            return batch
        self.stats["requests"] += len(take)
        if batch is None:
            return new
        try:
            with self._clock("kv_seconds"):
                return _merge(self.pool, batch, new)
        except Exception as exc:  # the loop fails `batch`'s rows; these are not in it yet
            self._fail_batch(new, exc, running=batch)
            raise

    @contextmanager
    def _clock(self, key: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.stats[key] += time.perf_counter() - started

    def _adapter(self, adapter: str | None) -> Any:
        if not hasattr(self.model, "disable_adapter"):
            return nullcontext()
        if adapter is None:
            return self.model.disable_adapter()
        self.model.set_adapter(adapter)
        return nullcontext()

    def _row(self, r: GenRequest) -> _Row:
        matcher = xgr.GrammarMatcher(r.grammar) if r.grammar is not None else None
        # Jump-forward: text the grammar forces at the start, e.g. '{"name":"act","arguments":
        # {"action":"', is prefilled with the prompt instead of decoded token by token.
        text = matcher.find_jump_forward_string() if matcher is not None else ""
        if text:
            matcher.accept_string(text)
        forced = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        gen = torch.Generator()
        gen.manual_seed(r.seed if r.seed is not None else torch.seed())
        return _Row(req=r, matcher=matcher, gen=gen, out_ids=list(forced), n_forced=len(forced))

    @torch.inference_mode()
    def _start(self, reqs: list[GenRequest], adapter: str | None) -> _Batch:
        with self._clock("grammar_seconds"):
            rows = [self._row(r) for r in reqs]
        prompts = [row.req.prompt_ids + row.out_ids for row in rows]
        with self._clock("kv_seconds"):
            hits = [self.prefix_cache.lookup(adapter, p) for p in prompts]
            for _, slots in hits:  # held now: making room for the prefills must not free them
                if slots is not None:
                    self.pool.hold(slots)
        new = [len(p) - m for p, (m, _) in zip(prompts, hits, strict=True)]
        groups = prefill_groups(new) if self.group_prefill else [list(range(len(rows)))]
        batch: _Batch | None = None
        done: _Batch | None = None
        started: set[int] = set()  # rows whose slots a prefill took over (and gives back if it fails)
        try:
            with self._adapter(adapter):
                for group in groups:
                    started.update(group)
                    part = self._prefill([prompts[i] for i in group], [hits[i] for i in group], adapter)
                    done = _Batch(adapter, [rows[i] for i in group], *part)
                    with self._clock("kv_seconds"):
                        batch = done if batch is None else _merge(self.pool, batch, done)
                    done = None  # its rows are the batch's now
        except BaseException:
            self._drop(batch)
            if done is not None:  # prefilled, then its merge failed
                self._drop(done)
            for i, (_, slots) in enumerate(hits):
                if slots is not None and i not in started:
                    self.pool.release(slots)
            raise
        assert batch is not None
        with self._clock("kv_seconds"):  # the bucket's padding before every row's first column
            _trim_left(self.pool, batch)
        return batch

    def _prefill(
        self, prompts: list[list[int]], hits: list[tuple[int, Any]], adapter: str | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batched forward over what the prefix cache does not already hold (`hits`: each
        prompt's cached prefix length and its slots, which the caller holds for the batch).

        Row i is laid out as [pad | cached prefix (m_i) | pad | new tokens (s_i)] — holes are
        masked out, positions are explicit — so hits and misses share one forward pass.
        Returns the rows' slot table, their attention mask, next positions and last logits.
        """
        n = len(prompts)
        news = [len(p) - m for p, (m, _) in zip(prompts, hits, strict=True)]
        past = shape_bucket(max(m for m, _ in hits), self.shape_buckets)
        width = shape_bucket(max(news), self.shape_buckets)
        chunks = prefill_chunks(n, width, self.prefill_chunk, self.shape_buckets)
        width = chunks[-1][1]  # the chunks may round it up to a whole number of chunks
        attn = torch.zeros((n, past + width), dtype=torch.long)
        input_ids = torch.full((n, width), self.tokenizer.pad_token_id, dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        # left padding reads zeros; padding among the new columns is written, never attended
        slots = torch.full((n, past + width), SCRATCH, dtype=torch.long)
        slots[:, :past] = PAD
        for i, (p, (m, prefix)) in enumerate(zip(prompts, hits, strict=True)):
            attn[i, past - m : past] = 1
            attn[i, past + width - news[i] :] = 1
            input_ids[i, width - news[i] :] = torch.tensor(p[m:])
            positions[i, width - news[i] :] = torch.arange(m, len(p))
            if prefix is not None:
                slots[i, past - m : past] = prefix
        try:  # from here the slot table holds the rows' slots: given back if anything fails
            with self._clock("kv_seconds"):
                fresh = self.pool.allocate(sum(news), self.prefix_cache.evict)
                ends = torch.tensor(news).cumsum(0).tolist()
                for i, end in enumerate(ends):
                    slots[i, past + width - news[i] :] = fresh[end - news[i] : end]
            cache = PagedCache(self.pool, slots, past)
            with self._clock("prefill_seconds"):
                for start, end in chunks:
                    out = self.model(
                        input_ids=input_ids[:, start:end],
                        attention_mask=attn[:, : past + end],
                        position_ids=positions[:, start:end],
                        cache=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    )
            with self._clock("kv_seconds"):
                for i, (p, (m, _)) in enumerate(zip(prompts, hits, strict=True)):
                    held = torch.cat([slots[i, past - m : past], slots[i, past + width - news[i] :]])
                    self.prefix_cache.store(adapter, p, held)
        except BaseException:
            self.pool.release(slots)
            raise
        self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
        self.stats["prefilled_tokens"] += sum(news)
        self.stats["prefill_slots"] += n * width
        self.stats["attended_pairs"] += n * width * (past + width)
        self.stats["attended_needed"] += sum(s * (m + s) for s, (m, _) in zip(news, hits, strict=True))
        next_pos = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return slots, attn, next_pos, out.logits[:, -1, :].float()

    def _forced_end(self, row: _Row) -> None:
        """Finish `row` now if its grammar forces the rest of the reply, stop token included.

        An action chosen from an enum is decided by its first distinct tokens; what follows
        (the rest of the action's name, the closing `"}}`, the stop token) is forced, and
        decoding it costs one forward per token for nothing: under the grammar's mask the
        forced token is the only one left, whatever the logits say. So the forced text is
        appended and the row answered at once. The reply's text, finish reason and grammar
        completeness are exactly what decoding token by token gives; only its token ids may
        be another split of the same text. Text that is forced but followed by another free
        choice is left to the decoder: how it is split into tokens changes the logits of that
        choice. Nor is anything jumped when the output budget could run out inside it (a
        token covers at least one byte, so `bytes < budget` is a sound bound)."""
        m, req = row.matcher, row.req
        assert m is not None
        text = m.find_jump_forward_string()
        if len(row.out_ids) - row.n_forced + len(text.encode()) >= req.max_tokens:
            return
        forced = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        accepted = 0
        for tok in forced:
            if not m.accept_token(tok):
                break
            accepted += 1
        stop = self._only_stop(m) if accepted == len(forced) else None
        if stop is None:
            if accepted:
                m.rollback(accepted)
            return
        m.accept_token(stop)
        row.out_ids.extend(forced)
        row.finish, row.complete = "stop", m.is_terminated()
        self.stats["forced_end_tokens"] += len(forced)
        self.stats["forced_ends"] += 1

    def _only_stop(self, m: xgr.GrammarMatcher) -> int | None:
        """The stop token, if it is the only token the grammar allows next (else None)."""
        if not m.is_completed():
            return None
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        m.fill_next_token_bitmask(mask, 0)
        probe = torch.zeros((1, self.vocab_size))
        xgr.apply_token_bitmask_inplace(probe, mask)
        allowed = torch.isfinite(probe[0]).nonzero().flatten().tolist()
        return allowed[0] if len(allowed) == 1 and allowed[0] in self.stop_ids else None

    @torch.inference_mode()
    def _step(self, b: _Batch) -> _Batch | None:
        """Sample one token for every live row, answer finished rows, feed the batch one step.

        A finished row is answered at once and rides along (fed a pad token, its logits
        ignored) until the next admission leaves it out, or until `compact_share` of the rows
        are finished; its slots are given back then."""
        live = [i for i, row in enumerate(b.rows) if row.finish is None]
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(live))
        n = len(b.rows)
        logits = b.logits[:, : self.vocab_size]
        if any(b.rows[i].matcher is not None for i in live):
            with self._clock("grammar_seconds"):
                bitmask = xgr.allocate_token_bitmask(n, self.vocab_size)
                for i in live:
                    if (matcher := b.rows[i].matcher) is not None:
                        matcher.fill_next_token_bitmask(bitmask, i)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
        greedy = logits.argmax(-1)
        temps = torch.tensor([max(row.req.temperature, 1e-5) for row in b.rows])
        probs = (
            torch.softmax(logits / temps[:, None], dim=-1)
            if any(b.rows[i].req.temperature > 0 for i in live)
            else None
        )
        tokens = torch.full((n,), self.tokenizer.pad_token_id, dtype=torch.long)
        for i in live:
            row = b.rows[i]
            req, m = row.req, row.matcher
            tok = (
                int(greedy[i])
                if req.temperature <= 0 or probs is None
                else _sample(probs[i], req.top_p, row.gen)
            )
            tokens[i] = tok
            if m is not None and not m.accept_token(tok):
                row.finish = "stop"  # cannot happen with a correct mask; stop rather than emit junk
            elif tok in self.stop_ids and not (req.ignore_eos and m is None):
                row.finish, row.complete = "stop", m is not None and m.is_terminated()
            else:
                row.out_ids.append(tok)
                if m is not None and m.is_terminated():
                    row.finish, row.complete = "stop", True
                elif len(row.out_ids) - row.n_forced >= req.max_tokens:
                    row.finish = "length"
                elif m is not None and self.forced_end:
                    with self._clock("grammar_seconds"):
                        self._forced_end(row)
            if row.finish is not None:
                self.stats["generated_tokens"] += len(row.out_ids)
                req.future.set_result(
                    GenResult(
                        token_ids=row.out_ids,
                        text=self.tokenizer.decode(row.out_ids, skip_special_tokens=True),
                        finish_reason=row.finish,
                        prompt_tokens=len(req.prompt_ids),
                        grammar_complete=row.complete,
                    )
                )
        keep = [i for i in live if b.rows[i].finish is None]
        if not keep:
            self._drop(b)
            return None
        if len(keep) < n and n - len(keep) >= self.compact_share * n:  # stop computing for them
            with self._clock("kv_seconds"):
                idx = torch.tensor(keep, dtype=torch.long)
                gone = torch.tensor([i for i in range(n) if i not in keep], dtype=torch.long)
                self.pool.release(b.slots[gone])
                b.rows, b.slots, b.attn, b.pos, tokens = (
                    [b.rows[i] for i in keep],
                    b.slots[idx],
                    b.attn[idx],
                    b.pos[idx],
                    tokens[idx],
                )
                _trim_left(self.pool, b)
        n = len(b.rows)
        with self._clock("kv_seconds"):  # the new column: a slot per live row, scratch for the rest
            column = torch.full((n, 1), SCRATCH, dtype=torch.long)
            live_now = torch.tensor([row.finish is None for row in b.rows])
            column[live_now] = self.pool.allocate(int(live_now.sum()), self.prefix_cache.evict)[:, None]
            b.slots = torch.cat([b.slots, column], dim=1)
        b.attn = torch.cat([b.attn, torch.ones((n, 1), dtype=torch.long)], dim=1)
        with self._adapter(b.adapter), self._clock("decode_seconds"):
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=b.attn,
                position_ids=b.pos[:, None],
                cache=PagedCache(self.pool, b.slots, b.slots.shape[1] - 1),
                use_cache=True,
            )
        self.stats["forward_steps"] += 1
        self.stats["attended_pairs"] += b.attn.numel()
        self.stats["attended_needed"] += int(b.attn.sum())
        b.logits = out.logits[:, -1, :].float()
        b.pos = b.pos + 1
        return b


def compile_json_schema(compiler: xgr.GrammarCompiler, schema: str) -> xgr.CompiledGrammar:
    """The grammar a `response_format` JSON schema is constrained by: compact JSON (no free
    whitespace for a model to loop in), no properties beyond the schema's, and a string's
    length bound kept where it also has a pattern (`server.schema_bounds`)."""
    bounded = json.dumps(bound_patterns(json.loads(schema)))
    return compiler.compile_json_schema(
        bounded, any_whitespace=False, separators=(",", ":"), strict_mode=True
    )


def shape_bucket(n: int, per_octave: int = SHAPE_BUCKETS) -> int:
    """`n` rounded up to one of `per_octave` (a power of two) evenly spaced sizes between
    two powers of two, at least 8: at most 25% more for 4 per octave (9 -> 10, 33 -> 40,
    1,100 -> 1,280). 0 stays 0; `per_octave` 0 leaves `n` as it is."""
    if per_octave <= 0 or n <= 0:
        return n
    if n <= 8:
        return 8
    step = _bucket_step(n, per_octave)
    return -(-n // step) * step


def _bucket_step(n: int, per_octave: int) -> int:
    """The spacing of the buckets just below or at `n` (> 1)."""
    return 1 << max(0, (n - 1).bit_length() - per_octave.bit_length())


def _bucket_floor(n: int, per_octave: int) -> int:
    """The largest bucket at most `n` (`n` itself below 8)."""
    if n < 8:
        return n
    step = _bucket_step(n, per_octave)
    return n // step * step


def prefill_chunks(rows: int, width: int, budget: int, per_octave: int = 0) -> list[tuple[int, int]]:
    """Column ranges [start, end) of a prefill `width` columns wide, each at most `budget`
    query tokens over `rows` rows (at least one column; `budget` 0: one range). With
    `per_octave`, every chunk's width is a bucket (`shape_bucket`): the last range may end
    past `width`, and the prefill pads its rows to that end."""
    step = width if budget <= 0 else max(1, budget // rows)
    if per_octave > 0 and step < width:
        step = _bucket_floor(step, per_octave)
        full, rest = divmod(width, step)
        width = full * step + shape_bucket(rest, per_octave)
    return [(start, min(width, start + step)) for start in range(0, width, step)]


def prefill_groups(new_tokens: list[int], slack: int = 16) -> list[list[int]]:
    """Row indices grouped for prefill, shortest first: a row joins the current group while
    its new-token count is at most twice the group's smallest plus `slack`, so no row pays
    for more than about twice its own width (plus one forward's fixed cost per group)."""
    order = sorted(range(len(new_tokens)), key=lambda i: new_tokens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and new_tokens[i] <= 2 * new_tokens[groups[-1][0]] + slack:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _sample(probs: torch.Tensor, top_p: float, gen: torch.Generator) -> int:
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        keep[0] = True  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


@dataclass
class _Row:
    req: GenRequest
    matcher: xgr.GrammarMatcher | None
    gen: torch.Generator
    out_ids: list[int]
    n_forced: int
    finish: str | None = None
    complete: bool = False


@dataclass
class _Batch:
    """The running batch: rows left-padded to a common width of columns, each column a slot of
    the engine's pool. Every slot number at or above `kv_pool.RESERVED` in `slots` is held once
    by the batch (released when its row leaves it)."""

    adapter: str | None
    rows: list[_Row]
    slots: torch.Tensor  # [rows, width] each column's slot in the pool (PAD where the row has none)
    attn: torch.Tensor  # [rows, width] 1 where a column belongs to the row
    pos: torch.Tensor  # [rows] position of each row's next token
    logits: torch.Tensor  # [rows, vocab] for each row's next token


def _refuse(req: GenRequest, exc: BaseException) -> None:
    """Answer `req` with `exc` unless it is answered already (two threads may try)."""
    try:
        req.future.set_exception(exc)
    except InvalidStateError:
        pass


@dataclass
class _Work:
    """The worker's requests in hand: waiting to be admitted, and the running batch."""

    pending: deque[GenRequest] = field(default_factory=deque)
    batch: _Batch | None = None


def _merge(pool: KVPool, a: _Batch, b: _Batch) -> _Batch:
    """The live rows of a, then b's, right-aligned to the widest (finished rows of a and columns
    nobody uses are left out and their slots given back). Only slot numbers move."""
    parts = [(x, [i for i, row in enumerate(x.rows) if row.finish is None]) for x in (a, b)]
    firsts = [_first_used(x.attn[rows]) for x, rows in parts]
    width = max(x.attn.shape[1] - first for (x, _), first in zip(parts, firsts, strict=True))

    def pick(t: torch.Tensor, rows: list[int], first: int, fill: int) -> torch.Tensor:  # [rows, cols]
        t = t[rows][:, first:]
        return F.pad(t, (width - t.shape[1], 0), value=fill)

    merged = _Batch(
        a.adapter,
        [x.rows[i] for x, rows in parts for i in rows],
        torch.cat([pick(x.slots, rows, f, PAD) for (x, rows), f in zip(parts, firsts, strict=True)]),
        torch.cat([pick(x.attn, rows, f, 0) for (x, rows), f in zip(parts, firsts, strict=True)]),
        torch.cat([x.pos[rows] for x, rows in parts]),
        torch.cat([x.logits[rows] for x, rows in parts]),
    )
    # only once the merged batch exists: a merge that fails has given nothing back
    for (x, rows), first in zip(parts, firsts, strict=True):
        gone = [i for i in range(len(x.rows)) if i not in rows]
        pool.release(x.slots[gone])
        pool.release(x.slots[rows][:, :first])  # unattended columns hold no slot; never leak one
    return merged


def _first_used(attn: torch.Tensor) -> int:
    """The first column any of these rows attends to."""
    used = torch.nonzero(attn.any(dim=0))
    return int(used[0]) if used.numel() else attn.shape[1]


def _trim_left(pool: KVPool, b: _Batch) -> None:
    """Drop leading columns no remaining row uses (left over from rows that finished)."""
    first = _first_used(b.attn)
    if 0 < first < b.attn.shape[1]:
        pool.release(b.slots[:, :first])
        b.slots, b.attn = b.slots[:, first:], b.attn[:, first:]
