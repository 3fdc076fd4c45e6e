"""`specrun bench hf`: Hugging Face transformers `generate` on a model directory, batch 1.

The comparison point for our own decoding of the same model (`specrun eval` reports ours,
speculative and plain; `specrun bench generate` on the CPU): the same prompts, encoded with
specrun's tokenizer and chat template, decoded greedily one at a time by
`LlamaForCausalLM.generate` (eager, dynamic KV cache, the library default) in bfloat16 or
float32, on the GPU or the CPU. One JSON line with tokens/s.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..models.tokenizer import Tokenizer
from ..runtime.distill.data import encode_prompts


def hf_generate_point(
    model_dir: str | Path,
    prompts: list,
    *,
    max_new_tokens: int,
    chat_template: bool = True,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Greedy `generate` of each prompt alone; tokens/s over all generated tokens.

    Args:
        model_dir: an HF Llama directory (specrun's converted default model works).
        prompts: strings (encoded like the engine encodes them) or token-id lists.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer.from_dir(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device)
    model.eval()
    encoded = encode_prompts(prompts, tokenizer, chat_template=chat_template)
    _generate(model, encoded[0], max_new_tokens=8, tokenizer=tokenizer)  # untimed warm-up
    num_tokens, seconds = 0, 0.0
    for ids in encoded:
        _synchronize(model.device)
        started = time.perf_counter()
        num_new = _generate(model, ids, max_new_tokens=max_new_tokens, tokenizer=tokenizer)
        _synchronize(model.device)
        seconds += time.perf_counter() - started
        num_tokens += num_new
    return {
        "engine": f"transformers generate (greedy, eager, {str(dtype).removeprefix('torch.')})",
        "device": str(model.device),
        "num_threads": torch.get_num_threads(),
        "num_prompts": len(encoded),
        "num_generated_tokens": num_tokens,
        "tokens_per_second": num_tokens / seconds,
    }


def _generate(model, ids: list[int], *, max_new_tokens: int, tokenizer: Tokenizer) -> int:
    inputs = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(tokenizer.eos_token_ids),
            pad_token_id=tokenizer.eos_token_ids[0],
        )
    return out.shape[1] - inputs.shape[1]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
