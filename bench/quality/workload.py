"""The model and the tokens one study scores: loaded from the model's GGUF and the text, or from an export.

`load_from_gguf` needs transformers, gguf and the model's file (models.py); `export_cache` writes what
`load_from_cache` reads on a machine without gguf or the model wheel (safetensors, the token stream and the
provenance that goes into every result).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.quality import assets, models
from bench.quality.text import DEFAULT_TEXT, load_text


@dataclass
class Workload:
    model: torch.nn.Module
    token_ids: torch.Tensor  # the whole tokenized text, 1-D int64
    provenance: dict  # model and text identity, written into every result


def load_from_gguf(
    text_dir: Path | None,
    allow_text_change: bool,
    model: str = models.DEFAULT_MODEL,
    text_name: str = DEFAULT_TEXT,
    assets_dir: Path = assets.DEFAULT_CACHE,
) -> Workload:
    # The text first: it is cheap, and a missing or changed text should fail before a minute of loading.
    # The Austen text sits next to the models (`<assets-dir>/austen`, as in a device bundle) unless told otherwise.
    if text_dir is None and text_name == "austen":
        text_dir = Path(assets_dir) / assets.AUSTEN_DIR
    text = load_text(text_dir, allow_text_change=allow_text_change, name=text_name)
    tokenizer, loaded, model_provenance = models.load_model(models.MODELS[model], assets_dir)
    token_ids = tokenizer(text.text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    provenance = {
        **model_provenance,
        "text_name": text_name,
        "text_source": text.source,
        "text_sha256": text.sha256,
        "text_files": list(text.files),
        "num_tokens": int(token_ids.numel()),
    }
    return Workload(loaded, token_ids, provenance)


def export_cache(workload: Workload, out_dir: Path, dtype: torch.dtype) -> None:
    """Write the model as safetensors + config, the token stream and the provenance into `out_dir`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    model = workload.model
    # A GGUF-loaded model refuses save_pretrained while it carries the GGUF quantizer markers; the weights
    # themselves are already plain dequantized tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(dtype).save_pretrained(out_dir / "model")
    model.to(torch.float32)
    save_file({"token_ids": workload.token_ids.to(torch.int32).contiguous()}, str(out_dir / "tokens.safetensors"))
    provenance = dict(workload.provenance, model=workload.provenance["model"] + f", exported as {dtype}")
    (out_dir / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")


def load_from_cache(cache_dir: Path) -> Workload:
    """Load what `export_cache` wrote; needs transformers and safetensors, not gguf."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    for needed in ("model/config.json", "tokens.safetensors", "provenance.json"):
        if not (cache_dir / needed).is_file():
            raise assets.MissingAsset(f"from_cache={str(cache_dir)!r} lacks {needed}; write it with --export")
    model = AutoModelForCausalLM.from_pretrained(cache_dir / "model", dtype=torch.float32)
    token_ids = load_file(str(cache_dir / "tokens.safetensors"))["token_ids"].to(torch.int64)
    provenance = json.loads((cache_dir / "provenance.json").read_text())
    provenance["loaded_from_cache"] = str(cache_dir)
    # Note [Tied or untied output layer] (models.py): the export must come back with the head the GGUF check saw.
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if provenance.get("output_layer", "").startswith("untied") and tied:
        raise ValueError(
            f"from_cache={str(cache_dir)!r}: the model was exported with an untied output layer "
            f"({provenance['output_layer']}) but loads tied; export it again"
        )
    return Workload(model.eval(), token_ids, provenance)
