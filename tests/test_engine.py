"""The batched decode engine in process, against the real model: prefix cache and batching."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engines(base_model_dir):
    from ratchet.server.engine import Engine

    cached, plain = Engine(base_model_dir), Engine(base_model_dir, prefix_cache_bytes=0)
    yield cached, plain
    cached.close()
    plain.close()


def _conversation(tok, steps: int) -> list[list[int]]:
    msgs = [
        {"role": "system", "content": "You play a text game."},
        {"role": "user", "content": "You are in the kitchen. There is a coin on the table."},
    ]
    prompts = []
    for i in range(steps):
        prompts.append(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        msgs += [
            {"role": "assistant", "content": f'{{"action":"look {i}"}}'},
            {"role": "user", "content": f"Result: you see thing {i}."},
        ]
    return prompts


def _user_prompt(tok, text: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_prefix_cache_reuses_earlier_prompts_and_changes_no_output(engines):
    from ratchet.server.engine import GenRequest

    cached, plain = engines
    prompts = _conversation(cached.tokenizer, 4)
    before = dict(cached.stats)
    for p in prompts:
        a = cached.generate(GenRequest(prompt_ids=p, max_tokens=16, temperature=0))
        b = plain.generate(GenRequest(prompt_ids=p, max_tokens=16, temperature=0))
        assert a.token_ids == b.token_ids
    prompt = cached.stats["prompt_tokens"] - before["prompt_tokens"]
    prefilled = cached.stats["prefilled_tokens"] - before["prefilled_tokens"]
    assert prompt == sum(len(p) for p in prompts)
    assert (
        prefilled
        <= len(prompts[0]) + sum(len(b) - len(a) for a, b in zip(prompts, prompts[1:], strict=False)) + 3 * 4
    )


def test_rollouts_that_share_a_system_prompt_store_it_once_and_answer_as_uncached(base_model_dir, engines):
    """Four rollouts of one game: the system prompt and first observation are one segment of
    the tree, each rollout's own turns another; a reply built from segments (the shared one
    split where a rollout parts) is the reply without any cache."""
    from ratchet.server.engine import Engine, GenRequest

    _, plain = engines
    tok = plain.tokenizer
    system = "You play a text game. " + "Find the coin; the rooms are dark. " * 20
    rollouts = []
    for r in range(4):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "You are in the kitchen."}]
        msgs += [{"role": "assistant", "content": f"go {['north', 'south', 'east', 'west'][r]}"}]
        msgs += [{"role": "user", "content": f"You are in room {r}. It is dark."}]
        rollouts.append(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    shared = next(i for i, column in enumerate(zip(*rollouts, strict=False)) if len(set(column)) > 1)
    assert shared > 150
    engine = Engine(base_model_dir)
    try:
        got = [
            engine.generate(GenRequest(prompt_ids=p, max_tokens=8, temperature=0)).token_ids for p in rollouts
        ]
        want = [
            plain.generate(GenRequest(prompt_ids=p, max_tokens=8, temperature=0)).token_ids for p in rollouts
        ]
        assert got == want
        cache = engine.prefix_cache
        per_token = cache.cached_bytes // cache.cached_tokens
        assert cache.cached_tokens == shared + sum(len(p) - shared for p in rollouts)  # not sum(len(p))
        assert cache.cached_bytes == per_token * cache.cached_tokens
        m, slots = cache.lookup(None, rollouts[2] + [1])
        assert m == len(rollouts[2]) and slots.numel() == m
        # the shared part is the same slots for every rollout: its keys and values exist once
        _, first = cache.lookup(None, rollouts[0] + [1])
        assert torch.equal(first[:shared], slots[:shared])
        assert not set(first[shared:].tolist()) & set(slots.tolist())
        # a rollout's next turn extends its own segment and is answered as without a cache
        more = rollouts[1] + tok.encode(" look", add_special_tokens=False)
        assert (
            engine.generate(GenRequest(prompt_ids=more, max_tokens=8, temperature=0)).token_ids
            == plain.generate(GenRequest(prompt_ids=more, max_tokens=8, temperature=0)).token_ids
        )
        assert len(cache._nodes()) == 5
    finally:
        engine.close()


def test_mixed_batch_of_hits_and_misses_matches_uncached(engines):
    from ratchet.server.engine import GenRequest

    cached, plain = engines
    tok = cached.tokenizer
    prompts = _conversation(tok, 3)
    cached.generate(GenRequest(prompt_ids=prompts[1], max_tokens=4, temperature=0))  # warm one prefix
    fresh = _user_prompt(tok, "Name three fruits.")
    batch = [prompts[2], fresh, prompts[1]]
    got = [
        f.result()
        for f in [cached.submit(GenRequest(prompt_ids=p, max_tokens=12, temperature=0)) for p in batch]
    ]
    want = [plain.generate(GenRequest(prompt_ids=p, max_tokens=12, temperature=0)) for p in batch]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert cached.stats["largest_batch"] >= 2


def test_a_request_joins_a_running_batch_and_is_answered_when_done(engines):
    import time

    from ratchet.server.engine import GenRequest

    cached, plain = engines
    tok = cached.tokenizer

    long_ids = _user_prompt(tok, "Write a long story about a lighthouse.")
    short_ids = _user_prompt(tok, "Say hello to Ada.")
    steps = cached.stats["forward_steps"]
    f_long = cached.submit(GenRequest(prompt_ids=long_ids, max_tokens=80, temperature=0, ignore_eos=True))
    while cached.stats["forward_steps"] < steps + 5:
        time.sleep(0.01)
    short = cached.submit(GenRequest(prompt_ids=short_ids, max_tokens=6, temperature=0)).result()
    assert not f_long.done()  # the short request joined mid-flight and left first
    assert cached.stats["in_flight"] in (1, 2)  # the long one; the short one until its callback ran
    assert (
        short.token_ids
        == plain.generate(GenRequest(prompt_ids=short_ids, max_tokens=6, temperature=0)).token_ids
    )
    want = plain.generate(GenRequest(prompt_ids=long_ids, max_tokens=80, temperature=0, ignore_eos=True))
    assert f_long.result().token_ids == want.token_ids
    deadline = time.monotonic() + 60  # a future's callbacks run just after its waiters wake
    while cached.stats["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cached.stats["in_flight"] == 0  # every request answered is counted out


def test_prefill_groups_bound_what_a_row_pays_for_its_neighbours():
    from ratchet.server.engine import prefill_groups

    assert prefill_groups([30, 800, 25, 40, 20]) == [[4, 2, 0, 3], [1]]  # the fresh prompt alone
    assert prefill_groups([100, 150, 180, 230, 500]) == [[0, 1, 2], [3], [4]]
    assert prefill_groups([7]) == [[0]] and prefill_groups([]) == []
    for lengths in ([1, 2, 3, 50, 51, 400, 999], [5] * 8):
        groups = prefill_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(max(lengths[i] for i in g) <= 2 * min(lengths[i] for i in g) + 16 for g in groups)


def test_grouped_prefill_pads_less_and_answers_the_same(base_model_dir, engines):
    """Agent steps beside a fresh prompt, admitted together: grouped, the steps do not pay for
    the fresh prompt's width; the tokens are the uncached engine's either way."""
    from ratchet.server.engine import Engine, GenRequest

    cached, plain = engines
    tok = cached.tokenizer
    steps = _conversation(tok, 6)
    fresh = _user_prompt(tok, "Describe a lighthouse in the fog, its keeper and the ships. " * 12)
    want = [
        plain.generate(GenRequest(prompt_ids=p, max_tokens=6, temperature=0)).token_ids
        for p in [*steps[1:], fresh]
    ]
    slots, pairs, needed = {}, {}, {}
    for grouped in (True, False):
        engine = Engine(base_model_dir, group_prefill=grouped, batch_wait_s=0.2)
        try:
            for p in steps[:-1]:  # each step's prefix is cached, as in a rollout
                engine.generate(GenRequest(prompt_ids=p, max_tokens=1, temperature=0))
            before = dict(engine.stats)
            futures = [
                engine.submit(GenRequest(prompt_ids=p, max_tokens=6, temperature=0))
                for p in [*steps[1:], fresh]
            ]
            assert [f.result().token_ids for f in futures] == want
            slots[grouped] = engine.stats["prefill_slots"] - before["prefill_slots"]
            pairs[grouped] = engine.stats["attended_pairs"] - before["attended_pairs"]
            needed[grouped] = engine.stats["attended_needed"] - before["attended_needed"]
        finally:
            engine.close()
    assert slots[True] * 2 < slots[False]
    # attention's query x key pairs: what the rows needed is the same either way (the same
    # prompts over the same cached prefixes, the same replies); grouping computes less padding
    assert needed[True] == needed[False] > 0
    assert needed[True] <= pairs[True] < pairs[False]


def test_prefill_chunks_cover_the_width_within_the_budget():
    from ratchet.server.engine import prefill_chunks

    assert prefill_chunks(8, 2000, 0) == [(0, 2000)]  # off: one forward
    assert prefill_chunks(8, 100, 2048) == [(0, 100)]
    assert prefill_chunks(8, 600, 2048) == [(0, 256), (256, 512), (512, 600)]
    assert prefill_chunks(4096, 3, 2048) == [(0, 1), (1, 2), (2, 3)]  # a column at least
    for rows, width, budget in [(1, 1, 7), (3, 1000, 64), (8, 2049, 2048)]:
        chunks = prefill_chunks(rows, width, budget)
        assert [c[0] for c in chunks[1:]] == [c[1] for c in chunks[:-1]] and chunks[-1][1] == width
        assert all(rows * (end - start) <= max(budget, rows) for start, end in chunks)


def test_shape_buckets_pad_by_at_most_a_quarter_and_are_few():
    from ratchet.server.engine import shape_bucket

    assert [shape_bucket(n) for n in (0, 1, 8, 9, 17, 33, 100, 1100)] == [0, 8, 8, 10, 20, 40, 112, 1280]
    assert shape_bucket(37, 0) == 37  # off
    buckets = {shape_bucket(n) for n in range(1, 2049)}
    assert len(buckets) <= 4 * 9  # 8, then four per power of two up to 2,048
    for n in range(1, 5000):
        b = shape_bucket(n)
        assert n <= b <= max(8, 1.25 * n) and shape_bucket(b) == b, n


def test_bucketed_prefill_chunks_are_buckets_within_the_budget():
    from ratchet.server.engine import prefill_chunks, shape_bucket

    assert prefill_chunks(8, 1536, 2048, 4) == [(i, i + 256) for i in range(0, 1536, 256)]
    assert prefill_chunks(3, 1536, 2048, 4) == [(0, 640), (640, 1280), (1280, 1536)]
    assert prefill_chunks(8, 100, 2048, 4) == [(0, 100)]  # one chunk: the width as it came
    for rows, width, budget in [(1, 3000, 2048), (3, 1000, 64), (8, 2049, 2048), (5, 999, 2048)]:
        chunks = prefill_chunks(rows, width, budget, 4)
        assert [c[0] for c in chunks[1:]] == [c[1] for c in chunks[:-1]] and chunks[-1][1] >= width
        assert all(shape_bucket(end - start) == end - start for start, end in chunks)
        assert all(rows * (end - start) <= budget for start, end in chunks)


def test_bucketed_prefills_answer_as_exact_ones_in_shapes_of_few_sizes(base_model_dir, engines):
    """Padding a prefill's cached and new columns up to a bucket changes no greedy token (fp32),
    and every prefill forward the model sees is a bucket wide over a bucket of cached columns.
    (fp32 prefills exact widths by default: it keeps nothing per shape.)"""
    from ratchet.server.engine import SHAPE_BUCKETS, Engine, GenRequest, shape_bucket

    exact, _ = engines
    assert exact.shape_buckets == 0  # the fp32 default
    tok = exact.tokenizer
    steps = _conversation(tok, 5)
    prompts = [*steps, _user_prompt(tok, "Describe the cellar and what is stored in it. " * 7)]
    bucketed = Engine(base_model_dir, shape_buckets=SHAPE_BUCKETS, batch_wait_s=0.2)
    seen: list[tuple[int, int]] = []

    def record(_module, _args, kwargs):  # (query columns, cached columns) of each forward
        q = kwargs["input_ids"].shape[1]
        seen.append((q, kwargs["attention_mask"].shape[1] - q))

    hook = bucketed.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        replies = []
        for engine in (exact, bucketed):  # one step first (a cached prefix), then all at once
            engine.generate(GenRequest(prompt_ids=steps[0], max_tokens=1, temperature=0))
            futures = [engine.submit(GenRequest(prompt_ids=p, max_tokens=8, temperature=0)) for p in prompts]
            replies.append([f.result().token_ids for f in futures])
    finally:
        hook.remove()
        bucketed.close()
    assert replies[1] == replies[0]
    prefills = [(q, past) for q, past in seen if q > 1]
    assert prefills and all(shape_bucket(q) == q and shape_bucket(past) == past for q, past in prefills)
    assert any(past > 0 for _, past in prefills)  # a cached prefix was padded too


def test_keys_and_values_stored_in_fp16_under_fp32_answer_as_fp32_ones(base_model_dir, engines):
    """An fp32 model stores keys and values in fp16 by default: half the bytes a token, and on
    these prompts (a game's steps, cache hits among them, and a long fresh prompt) the same
    greedy tokens as an fp32 pool."""
    from ratchet.server.engine import Engine, GenRequest

    engine, _ = engines
    assert engine.dtype == torch.float32 and engine.pool.keys[0].dtype == torch.float16  # the default
    tok = engine.tokenizer
    prompts = [*_conversation(tok, 5), _user_prompt(tok, "Describe the cellar and its shelves. " * 7)]

    def replies(e: Engine) -> list[list[int]]:
        return [e.generate(GenRequest(prompt_ids=p, max_tokens=12, temperature=0)).token_ids for p in prompts]

    before = dict(engine.stats)
    got = replies(engine)
    prefilled = engine.stats["prefilled_tokens"] - before["prefilled_tokens"]
    assert prefilled < engine.stats["prompt_tokens"] - before["prompt_tokens"]  # the steps hit the cache
    wide = Engine(base_model_dir, kv_dtype=torch.float32)
    try:
        assert wide.pool.slot_bytes == 2 * engine.pool.slot_bytes
        want = replies(wide)
    finally:
        wide.close()
    assert got == want


def test_a_prefill_in_chunks_answers_what_one_forward_does(base_model_dir, engines):
    """Rows of different widths, cache hits beside misses, chunks smaller than the shortest
    row's new tokens: the same greedy tokens as the uncached engine's single forwards, and the
    prefix cache keeps what the chunks computed (the next step reuses it)."""
    from ratchet.server.engine import Engine, GenRequest

    _, plain = engines
    tok = plain.tokenizer
    steps = _conversation(tok, 5)
    fresh = _user_prompt(tok, "Describe a lighthouse in the fog and its keeper. " * 6)
    batch = [steps[2], fresh, steps[4]]
    want = [plain.generate(GenRequest(prompt_ids=p, max_tokens=12, temperature=0)).token_ids for p in batch]
    engine = Engine(base_model_dir, prefill_chunk=48, group_prefill=False, batch_wait_s=0.2)
    try:
        engine.generate(GenRequest(prompt_ids=steps[1], max_tokens=1, temperature=0))  # a cached prefix
        forwards = engine.stats["prefill_slots"]
        futures = [engine.submit(GenRequest(prompt_ids=p, max_tokens=12, temperature=0)) for p in batch]
        assert [f.result().token_ids for f in futures] == want
        assert engine.stats["prefill_slots"] > forwards
        assert engine.prefix_cache.lookup(None, steps[4] + [1])[0] == len(steps[4])
        again = engine.generate(GenRequest(prompt_ids=steps[4], max_tokens=12, temperature=0))
        assert again.token_ids == want[2]
    finally:
        engine.close()


def test_the_worker_accounts_for_its_time_by_part(base_model_dir):
    """bench/profile_generation.py reads these clocks: each part must be counted once, inside
    the worker's busy time, and a grammar-constrained request must show grammar time."""
    import json

    from ratchet.server.engine import Engine, GenRequest

    engine = Engine(base_model_dir)
    try:
        tok = engine.tokenizer
        schema = {"type": "object", "properties": {"a": {"enum": ["north", "south"]}}, "required": ["a"]}
        grammar = engine.compile_json_schema(json.dumps(schema))
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "Which way?"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        futures = [
            engine.submit(GenRequest(prompt_ids=prompt, max_tokens=12, temperature=0, grammar=grammar))
        ]
        futures += [
            engine.submit(GenRequest(prompt_ids=prompt + [i + 100], max_tokens=5, temperature=0))
            for i in range(2)
        ]
        for f in futures:
            f.result()
        s = engine.stats
        parts = ("prefill_seconds", "decode_seconds", "grammar_seconds", "kv_seconds")
        assert all(s[k] > 0 for k in parts)
        assert sum(s[k] for k in parts) <= s["busy_seconds"]
    finally:
        engine.close()


def test_batched_decoding_matches_transformers_generate(engines, base_model_dir):
    """The engine's own decode loop (in-place KV cache, rows joining and leaving, finished
    rows riding along until the next admission drops them, prefix cache) against
    `model.generate` one prompt at a time: the same greedy tokens."""
    from ratchet.server.engine import GenRequest

    cached, _ = engines
    tok, model = cached.tokenizer, cached.model
    texts = [
        "Name three colours.",
        "You are in a kitchen. What do you do first?",
        "Count to five.",
        "Describe a lighthouse at night in two sentences.",
        "What is a coin?",
    ]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts
    ]
    sizes = [30, 6, 24, 12, 10]  # rows leave the batch at different steps

    def submit(i: int):  # type: ignore[no-untyped-def]
        return cached.submit(GenRequest(prompt_ids=prompts[i], max_tokens=sizes[i], temperature=0))

    futures = [submit(i) for i in range(3)]
    futures[1].result()  # one row finished while two still run: it rides along
    futures += [submit(3), submit(4)]  # joining rows: the merge leaves the finished one out
    for p, n, f in zip(prompts, sizes, futures, strict=True):
        out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
        want = out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
        assert f.result().token_ids == want


def test_folded_grouped_attention_gives_the_same_logits_to_the_bit(base_model_dir, monkeypatch):
    """`server.attention` folds the 9 query heads onto their 3 key/value heads in a masked
    prefill instead of copying keys and values per head: rows with holes on the left (as the
    engine lays out cached prefixes), a cached past, several new tokens per row. The logits
    must be exactly transformers' own `sdpa`, or greedy replies could change."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from ratchet.server import attention

    def load(impl: str):  # type: ignore[no-untyped-def]
        return AutoModelForCausalLM.from_pretrained(
            base_model_dir, dtype=torch.float32, attn_implementation=impl
        )

    models = [load(impl).eval() for impl in ("sdpa", attention.NAME)]

    def fallback(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a masked prefill went to transformers' sdpa: nothing was folded")

    monkeypatch.setattr(attention, "sdpa_attention_forward", fallback)  # the stock model calls its own
    assert models[0].config.num_attention_heads > models[0].config.num_key_value_heads  # grouped
    gen = torch.Generator().manual_seed(0)
    n, past, width = 4, 300, 24
    ids = torch.randint(0, 49000, (n, past + width), generator=gen)
    attn = torch.ones(n, past + width, dtype=torch.long)
    for i in range(n):
        attn[i, : 41 * i] = 0  # a hole of another width in every row
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = []
    with torch.inference_mode():
        for model in models:
            cache = DynamicCache()
            head, tail = slice(0, past), slice(past, None)
            model(
                input_ids=ids[:, head], attention_mask=attn[:, head], position_ids=pos[:, head], cache=cache
            )
            out = model(input_ids=ids[:, tail], attention_mask=attn, position_ids=pos[:, tail], cache=cache)
            logits.append(out.logits)
    assert torch.equal(logits[0], logits[1])


def test_an_idle_engine_gives_a_finished_batchs_memory_back(engines):
    """glibc keeps freed heap pages mapped: without the idle release the server stays as
    large as its largest batch (bench/server_memory.py). After a batch of long prompts and a
    pause the resident memory falls again, and a busy engine answers as before."""
    import random
    import time

    from ratchet.server.engine import GenRequest
    from ratchet.server.memory import resident_mb

    engine = engines[1]  # no prefix cache: what stays resident is only what a batch left
    assert engine.release_idle_s is not None and engine.release_idle_s < 1
    rng = random.Random(0)
    reqs = [
        GenRequest([rng.randrange(100, 40_000) for _ in range(400)], max_tokens=2, temperature=0)
        for _ in range(4)
    ]
    for f in [engine.submit(r) for r in reqs]:
        f.result()
    after_batch, releases = resident_mb()["rss_mb"], engine.stats["memory_releases"]
    time.sleep(engine.release_idle_s + 1.0)
    idle = resident_mb()["rss_mb"]
    assert engine.stats["memory_releases"] == releases + 1  # once per idle pause, not per wait
    assert idle < after_batch - 40, (after_batch, idle)  # 4 x 400 tokens: ~200 MB measured
    again = engine.generate(GenRequest(reqs[0].prompt_ids, max_tokens=2, temperature=0))
    assert again.token_ids == reqs[0].future.result().token_ids


def test_the_pool_holds_only_what_the_cache_stores_once_requests_end_or_fail(base_model_dir):
    """Slots are counted by reference: after any mix of requests, and after a prefill, a
    decode step or a merge that fails, every hold on a slot is the prefix cache's, once per
    token it stores (none left by a finished, dropped or failed row), and the engine serves on."""
    import ratchet.server.engine as engine_module
    from ratchet.server import kv_pool
    from ratchet.server.engine import Engine, GenRequest

    engine = Engine(base_model_dir)
    try:
        tok = engine.tokenizer
        prompts = [*_conversation(tok, 4), _user_prompt(tok, "Name three fruits."), _user_prompt(tok, "Hi.")]
        futures = [engine.submit(GenRequest(prompt_ids=p, max_tokens=6, temperature=0)) for p in prompts]
        assert all(f.result().token_ids for f in futures)

        def leaks() -> int:
            with engine._lock:  # a reply is sent inside the worker's step; its slots go back at its end
                held = int(engine.pool.refs[kv_pool.RESERVED :].sum())  # holds, not just slots held
                return held - engine.prefix_cache.cached_tokens

        assert engine.prefix_cache.cached_tokens > 0 and leaks() == 0
        real = engine.model.forward
        for failing_call in (1, 2):  # the prefill fails; the prefill passes and a decode step fails

            def flaky(*args, calls=[], failing_call=failing_call, **kwargs):  # noqa: B006 - counts this one's calls
                calls.append(1)
                if len(calls) == failing_call:
                    raise RuntimeError("injected")
                return real(*args, **kwargs)

            engine.model.forward = flaky
            request = GenRequest(prompt_ids=_user_prompt(tok, f"Count to {failing_call}."), max_tokens=6)
            with pytest.raises(RuntimeError, match="injected"):
                engine.generate(request)
            engine.model.forward = real
            assert leaks() == 0
        # a merge that fails (rows of two prefill groups, or new rows joining a running batch)
        cached = engine.prefix_cache.cached_tokens
        merge = engine_module._merge
        engine_module._merge = lambda *a: (_ for _ in ()).throw(RuntimeError("injected merge"))
        try:
            short, long = _user_prompt(tok, "Hi there."), _user_prompt(tok, "Tell me a story. " * 30)
            pair = [engine.submit(GenRequest(prompt_ids=p, max_tokens=6)) for p in (short, long)]
            assert any(isinstance(f.exception(), RuntimeError) for f in pair)
        finally:
            engine_module._merge = merge
        assert leaks() == 0
        assert engine.prefix_cache.cached_tokens >= cached  # counted right: nothing to start over
        assert engine.generate(GenRequest(prompt_ids=prompts[0], max_tokens=4, temperature=0)).token_ids
        assert leaks() == 0
    finally:
        engine.close()


def test_a_pool_grown_during_a_prefill_serves_on_and_answers_as_uncached(base_model_dir, engines):
    """The pool grows inside the prefill's inference mode; merges and releases run outside it.
    A pool grown there once made the next merge fail ("inplace update to inference tensor"),
    and the cleanup after it stopped the engine's worker: every later request hung."""
    import time

    from ratchet.server import kv_pool
    from ratchet.server.engine import Engine, GenRequest

    _, plain = engines
    engine = Engine(base_model_dir, prefix_cache_bytes=1)  # room for no token: every prefill grows it
    try:
        tok = engine.tokenizer
        long_ids = _user_prompt(tok, "Write a long story about a lighthouse.")
        steps = engine.stats["forward_steps"]
        first = engine.submit(GenRequest(prompt_ids=long_ids, max_tokens=40, temperature=0, ignore_eos=True))
        while engine.stats["forward_steps"] < steps + 3:
            time.sleep(0.01)
        assert engine.pool.grown >= 1 and not first.done()
        joined = [*_conversation(tok, 3), _user_prompt(tok, "Say hello to Ada.")]  # merged mid-flight
        futures = [engine.submit(GenRequest(prompt_ids=p, max_tokens=6, temperature=0)) for p in joined]
        for p, f in zip(joined, futures, strict=True):
            want = plain.generate(GenRequest(prompt_ids=p, max_tokens=6, temperature=0))
            assert f.result(timeout=300).token_ids == want.token_ids
        want = plain.generate(GenRequest(prompt_ids=long_ids, max_tokens=40, temperature=0, ignore_eos=True))
        assert first.result(timeout=300).token_ids == want.token_ids
        with engine._lock:
            held = int(engine.pool.refs[kv_pool.RESERVED :].sum())
            assert held == engine.prefix_cache.cached_tokens  # the finished rows gave theirs back
    finally:
        engine.close()


def test_a_failure_in_the_cleanup_of_a_failure_resets_the_pool_and_serves_on(base_model_dir):
    """If a failed batch cannot give its slots back either, the counts are not trusted: every
    slot is freed, the prefix cache starts empty, and the next request is served."""
    from ratchet.server import kv_pool
    from ratchet.server.engine import Engine, GenRequest

    engine = Engine(base_model_dir)
    try:
        tok = engine.tokenizer
        hello = _user_prompt(tok, "Say hello to Ada.")
        want = engine.generate(GenRequest(prompt_ids=hello, max_tokens=4, temperature=0)).token_ids
        assert engine.prefix_cache.cached_tokens > 0
        real_forward, real_release = engine.model.forward, engine.pool.release

        def failing(*args, **kwargs):
            raise RuntimeError("injected")

        engine.model.forward, engine.pool.release = failing, failing
        try:
            with pytest.raises(RuntimeError, match="injected"):
                engine.generate(GenRequest(prompt_ids=_user_prompt(tok, "Count to 3."), max_tokens=4))
        finally:
            engine.model.forward, engine.pool.release = real_forward, real_release
        with engine._lock:
            assert engine.prefix_cache.cached_tokens == 0 and engine.pool.in_use() == 0
            assert int(engine.pool.refs[: kv_pool.RESERVED].min()) > 0  # the reserved slots stay pinned
        assert engine.generate(GenRequest(prompt_ids=hello, max_tokens=4, temperature=0)).token_ids == want
    finally:
        engine.close()


def test_a_worker_that_stops_answers_every_waiting_request_with_why(base_model_dir):
    """A bug in the worker's loop itself stops it: what waits is answered with the reason,
    and later requests are refused at once, not left hanging."""
    from ratchet.server.engine import Engine, GenRequest

    class LoopBug(BaseException):
        pass

    engine = Engine(base_model_dir)
    try:
        tok = engine.tokenizer

        def broken(*args, **kwargs):
            raise LoopBug("injected")

        engine._admit = broken
        waiting = engine.submit(GenRequest(prompt_ids=_user_prompt(tok, "Hi."), max_tokens=4))
        with pytest.raises(RuntimeError, match="engine stopped .*LoopBug: injected.*restart"):
            waiting.result(timeout=60)
        engine._worker.join(timeout=60)
        assert not engine._worker.is_alive()
        with pytest.raises(RuntimeError, match="engine stopped"):
            engine.submit(GenRequest(prompt_ids=_user_prompt(tok, "Hi again."), max_tokens=4))
    finally:
        engine.close()
