"""`specrun bench gpt-fast`: gpt-fast's own decoding loop on random weights, the side-by-side
comparison point for `specrun bench decode`'s plain step.

gpt-fast (github.com/pytorch-labs/gpt-fast) is not a dependency and is never vendored: the
caller fetches it into a folder of their own and passes `--path`. This module imports its
`model.py` and `generate.py` from there, builds `Transformer.from_name(--model)` with random
bf16 weights on the GPU (the same cost as real ones), compiles `decode_one_token` as its
`main` does (`mode="reduce-overhead", fullgraph=True`, with its module-level Inductor
settings: coordinate-descent tuning), and runs its `generate` at batch 1:

- tokens/s as gpt-fast prints it: new tokens over the wall time of one `generate` call
  (prefill included), median over `--runs` after one warm-up run that compiles;
- decode ms per token: `decode_n_tokens` alone between two CUDA events, the figure that
  compares with a replayed plain step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import statistics
import sys
import time
import types
from pathlib import Path

import torch


def register(subjects: argparse._SubParsersAction) -> None:
    """The `bench gpt-fast` sub-command and its options."""
    parser = subjects.add_parser(
        "gpt-fast", help="gpt-fast's generate on random weights (a fetched gpt-fast folder)"
    )
    parser.add_argument("--path", required=True, type=Path, help="a gpt-fast checkout")
    parser.add_argument("--model", default="llama-3.1-8b", help="gpt-fast's config name")
    parser.add_argument("--prompt-length", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the JSON line here")
    parser.set_defaults(func=run_gpt_fast)


def run_gpt_fast(args: argparse.Namespace) -> int:
    import json

    from .bench_env import environment

    if not (args.path / "generate.py").is_file() or not (args.path / "model.py").is_file():
        raise ValueError(
            f"--path {args.path} holds no gpt-fast checkout (generate.py and model.py); clone "
            "github.com/pytorch-labs/gpt-fast there"
        )
    if not torch.cuda.is_available():
        raise ValueError("bench gpt-fast needs a CUDA GPU")
    point = environment() | gpt_fast_point(
        args.path,
        model_name=args.model,
        prompt_length=args.prompt_length,
        num_new_tokens=args.new_tokens,
        num_runs=args.runs,
    )
    line = json.dumps(point)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


def gpt_fast_point(
    path: Path, *, model_name: str, prompt_length: int, num_new_tokens: int, num_runs: int
) -> dict:
    """gpt-fast's tokens/s and decode ms per token for `model_name` at batch 1."""
    if any(importlib.util.find_spec(name) is None for name in ("sentencepiece", "tiktoken")):
        # generate.py imports its tokenizer module, which needs both; no tokens are decoded here.
        sys.modules.setdefault("tokenizer", types.ModuleType("tokenizer")).get_tokenizer = None
    sys.path.insert(0, str(path.resolve()))
    try:
        generate = importlib.import_module("generate")
        model_module = importlib.import_module("model")
    finally:
        sys.path.pop(0)
    with torch.device("cuda"), _default_dtype(torch.bfloat16):
        model = model_module.Transformer.from_name(model_name)
    model = model.eval()
    num_bytes = sum(p.numel() * p.itemsize for p in model.parameters())
    num_bytes -= model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.itemsize
    generate.decode_one_token = torch.compile(
        generate.decode_one_token, mode="reduce-overhead", fullgraph=True
    )
    prompt = torch.randint(0, model.config.vocab_size, (prompt_length,), device="cuda")
    sampling = {"temperature": 0.8, "top_k": 200}  # gpt-fast's defaults

    def run() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate.generate(
            model, prompt, num_new_tokens, 1, interactive=False, draft_model=None, **sampling
        )
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run()  # compiles
    seconds = [run() for _ in range(num_runs)]
    tokens_per_second = num_new_tokens / statistics.median(seconds)
    return {
        "bench": "gpt-fast",
        "model": model_name,
        "prompt_length": prompt_length,
        "new_tokens": num_new_tokens,
        "tokens_per_s": tokens_per_second,
        "tokens_per_s_runs": [num_new_tokens / s for s in seconds],
        "weight_gb_per_s": num_bytes * tokens_per_second / 1e9,
        "decode_ms_per_token": _decode_ms_per_token(
            generate, model, prompt, num_new_tokens - 1, sampling
        ),
    }


def _decode_ms_per_token(
    generate, model, prompt: torch.Tensor, num_tokens: int, sampling: dict
) -> float:
    """`decode_n_tokens` alone (with the sampling arguments `generate` compiled it for), after
    a prefill into the caches the last `generate` set up (room for the prompt and
    `num_tokens` more), between two CUDA events; the second of two passes."""
    with torch.no_grad():
        for _ in range(2):
            positions = torch.arange(0, prompt.numel(), device="cuda")
            token = generate.prefill(model, prompt.view(1, -1), positions, **sampling).clone()
            position = torch.tensor([prompt.numel()], device="cuda", dtype=torch.int)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            generate.decode_n_tokens(model, token.view(1, -1), position, num_tokens, **sampling)
            end.record()
            end.synchronize()
    return start.elapsed_time(end) / num_tokens


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
