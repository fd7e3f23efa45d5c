"""A small random Llama and its logits under one attention implementation, for the transformers-backend tests
(test_hf_attention.py, test_hf_fp8.py)."""

import torch
import transformers


def tiny_llama(seed: int, num_layers: int = 2, head_dim: int = 64) -> torch.nn.Module:
    """A random Llama with GQA (6 query heads over 2 KV heads). Head dim 64, the model's (FA4 head dims only)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(config).eval()


def logits(model, attention: str, input_ids, attention_mask=None) -> torch.Tensor:
    model.set_attn_implementation(attention)
    with torch.inference_mode():
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
