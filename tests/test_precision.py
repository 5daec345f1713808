"""The embedded model's number format: which CPUs get bf16, and the engine serving in it."""

from __future__ import annotations

import json

import pytest
import torch

from ratchet.server.precision import cpu_flags, native_bf16, resolve

ZEN4 = {"avx2", "avx512f", "avx512_bf16"}
SAPPHIRE_RAPIDS = {"avx2", "avx512f", "amx_bf16", "amx_tile"}
NO_BF16 = {"avx2", "avx512f", "avx512_vnni"}  # AVX-512 alone emulates bf16: slower than fp32


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (ZEN4, torch.bfloat16),
        (SAPPHIRE_RAPIDS, torch.bfloat16),
        (NO_BF16, torch.float32),
        (set(), torch.float32),
    ],
)
def test_auto_is_bf16_only_where_the_cpu_multiplies_it_natively(flags, expected):
    assert resolve("auto", flags) is expected


def test_an_explicit_format_wins_over_the_cpu():
    assert resolve("float32", ZEN4) is torch.float32
    assert resolve("bfloat16", NO_BF16) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        resolve("fp8", ZEN4)  # type: ignore[arg-type]


def test_flags_are_read_from_cpuinfo_and_a_missing_file_means_none(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\nbugs\t\t: spectre_v1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert native_bf16(cpu_flags(info))
    assert cpu_flags(tmp_path / "absent") == set()  # e.g. not Linux: fp32, the safe choice
    assert not native_bf16(set())


def test_the_setting_is_validated_in_one_line():
    from ratchet.config import load_settings
    from ratchet.errors import ConfigError

    assert load_settings({}).model.dtype == "auto"  # bf16 where the CPU has bf16 units (server/precision.py)
    assert load_settings({"model.dtype": "bfloat16"}).model.dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"model\.dtype") as info:
        load_settings({"model.dtype": "int4"})
    assert "\n" not in str(info.value)


@pytest.mark.integration
def test_a_bf16_engine_serves_constrained_replies_and_lora_adapters(base_model_dir, tmp_path):
    """The engine in bf16 on any CPU (emulated where there are no bf16 units): weights and
    cache in bf16, logits read in fp32, a grammar still holds every reply to its schema, and
    an fp32 LoRA adapter loads onto the bf16 base and changes what it says."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ratchet.server.engine import SHAPE_BUCKETS, Engine, GenRequest

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(tmp_path / "adapter")

    engine = Engine(base_model_dir, dtype=torch.bfloat16)
    try:
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        assert engine.shape_buckets == SHAPE_BUCKETS  # bf16 pads prefills to few shapes
        tok = engine.tokenizer
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "Pick a room to go to."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        schema = {
            "type": "object",
            "properties": {"room": {"enum": ["kitchen", "pantry", "garden"]}},
            "required": ["room"],
            "additionalProperties": False,
        }
        grammar = engine.compile_json_schema(json.dumps(schema))
        replies = [
            engine.generate(
                GenRequest(prompt_ids=prompt, max_tokens=24, temperature=t, seed=1, grammar=grammar)
            )
            for t in (0.0, 1.0)
        ]
        for r in replies:
            assert r.grammar_complete and json.loads(r.text)["room"] in {"kitchen", "pantry", "garden"}
        free = engine.generate(GenRequest(prompt_ids=prompt, max_tokens=12, temperature=0))
        assert free.text.strip()  # no NaN garbage: bf16 logits still say something

        engine.load_adapter("t1", str(tmp_path / "adapter"))
        tuned = engine.generate(GenRequest(prompt_ids=prompt, max_tokens=12, temperature=0, adapter="t1"))
        assert tuned.text != free.text  # the adapter acts on the bf16 base
    finally:
        engine.close()


@pytest.mark.integration
def test_the_loop_logs_the_format_the_server_runs_not_the_one_the_settings_name(embedded_server, tmp_path):
    """A caller may hand the loop a server it started in another format (bench/results/bf16_heldout.json
    does): the generation's `model_dtype` must be the server's word, not the settings'."""
    from ratchet.config import load_settings
    from ratchet.flows.runtime import open_runtime
    from ratchet.server.launcher import served_dtype

    served = served_dtype(embedded_server)
    assert served in ("float32", "bfloat16")
    other = "float32" if served == "bfloat16" else "bfloat16"
    s = load_settings({"data_dir": tmp_path, "suite": "reasoning-gym:chain_sum", "model.dtype": other})
    with open_runtime(s, base_url=embedded_server) as rt:
        assert rt.model_dtype == served


def test_a_server_that_does_not_say_its_format_is_reported_as_unknown():
    """llama.cpp's server answers /health with no dtype; a closed port answers nothing."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ratchet.server.launcher import free_port, served_dtype

    class Foreign(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = {
                "/health": b'{"status": "ok"}',
                "/odd/health": b"[1, 2]",
                "/long/health": b'{"dtype": "' + b"x" * 10_000 + b'"}',
                "/markup/health": b'{"dtype": "<b>bf16</b>"}',
            }.get(self.path, b"not json")
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert served_dtype(f"http://127.0.0.1:{port}/v1") is None
        assert served_dtype(f"http://127.0.0.1:{port}/odd/v1") is None  # JSON, but not an object
        assert served_dtype(f"http://127.0.0.1:{port}/junk/v1") is None  # not JSON
        assert served_dtype(f"http://127.0.0.1:{port}/long/v1") is None  # would overflow an MLflow param
        assert served_dtype(f"http://127.0.0.1:{port}/markup/v1") is None  # not a format name
    finally:
        server.shutdown()
    assert served_dtype(f"http://127.0.0.1:{free_port()}/v1", timeout=2) is None
