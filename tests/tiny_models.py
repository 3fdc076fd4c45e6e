"""Test helpers: tiny random Llama configs and models (importable as `tiny_models`)."""

from __future__ import annotations

import torch

from specrun.models.config import LlamaConfig
from specrun.models.llama import Llama


def tiny_config(**overrides) -> LlamaConfig:
    fields = {
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
    }
    return LlamaConfig(**(fields | overrides))


def random_llama(
    config: LlamaConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Llama:
    """A Llama with random weights large enough that greedy outputs are not degenerate."""
    torch.manual_seed(seed)
    model = Llama(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 if param.dim() > 1 else 0.1)
        model.embed_tokens.weight.normal_(0.0, 1.0)
    return model.to(dtype).eval()
