"""`specrun convert`: turn a GGUF Llama into a Hugging Face model directory.

Without arguments it converts the embedded SmolLM2-135M-Instruct GGUF into the cache directory
the runtime loads it from (what first use does automatically); `--gguf` and `--out` point it at
any llama-architecture GGUF and any output directory.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..models.default import (
    cache_dir_for,
    convert_atomically,
    converted_model_dir,
    embedded_gguf_path,
    is_converted,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a GGUF Llama into a Hugging Face directory (default: embedded)"
    )
    parser.add_argument(
        "--gguf", type=Path, default=None, help="GGUF file (default: the embedded SmolLM2 GGUF)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: the specrun cache)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype (with --out)"
    )
    parser.add_argument(
        "--force", action="store_true", help="reconvert / overwrite an existing output"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    gguf_path = args.gguf if args.gguf is not None else embedded_gguf_path()
    dtype = DTYPES[args.dtype]
    started = time.perf_counter()
    if args.out is None:
        if dtype != torch.float32:
            raise ValueError("--dtype needs --out; the cache the runtime reads holds float32")
        cached = cache_dir_for(gguf_path)
        if is_converted(cached) and not args.force:
            print(f"{cached} (already converted; --force reconverts)")
            return 0
        out = converted_model_dir(gguf_path, force=args.force)
    else:
        out = convert_atomically(gguf_path, args.out, replace=args.force, dtype=dtype)
    print(f"{out} ({time.perf_counter() - started:.1f} s)")
    return 0
