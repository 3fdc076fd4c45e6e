"""A fresh process for tests/graphs/test_artifacts.py (run as a script, not collected).

`build`: load the model (and head), build artifacts with `runtime.aot.build`, then decode the
test prompts with the same decoder (its rounds are the precompiled ones), and greedily with
an eager decoder as the reference. `load`: load the artifacts into a new decoder and decode
the same prompts. Either way it prints one JSON line: the generated tokens, the process's
compile counters, and how the round steps ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from specrun.models.loading import load_draft, load_target
from specrun.runtime import aot
from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.engine import Engine
from specrun.runtime.graphs.artifacts import compile_counters
from specrun.runtime.tree import TreeShape

PROMPTS = ([5, 17, 3, 44, 9, 12], [7, 7, 30], [2])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["build", "load"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--buckets", type=int, nargs="+", default=[1])
    parser.add_argument("--tree", type=int, nargs=3, default=[2, 2, 4])
    parser.add_argument("--max-seq-len", type=int, default=64)
    parser.add_argument("--stochastic", action="store_true", help="a stochastic --tree")
    parser.add_argument("--filtered", action="store_true")
    parser.add_argument("--policy", default="fixed", help="EngineConfig.policy")
    parser.add_argument("--engine", action="store_true", help="load: Engine.from_pretrained")
    parser.add_argument("--only-buckets", type=int, nargs="+", default=None, help="build: a part")
    args = parser.parse_args()
    started = time.perf_counter()
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        buckets=tuple(args.buckets),
        trees={1: TreeShape(*args.tree, stochastic=args.stochastic)},
        max_seq_len=args.max_seq_len,
        compile=True,
        policy=args.policy,
    )
    use_engine = args.engine and args.mode == "load"
    if use_engine:
        engine = Engine.from_pretrained(
            args.model, draft=args.draft, config=config, artifacts=args.out
        )
        decoder = engine.decoder
    else:
        target = load_target(
            args.model, dtype=config.resolved_dtype(), device=config.resolved_device()
        )
        head = load_draft(args.draft, target=target) if args.draft else None
        decoder = Decoder(target, head, config)
    if args.mode == "build":
        aot.build(decoder, args.out, filtered=args.filtered, buckets=args.only_buckets)
    elif not use_engine:
        aot.load_into(decoder, args.out, rebuild="specrun compile ...")
    ready = time.perf_counter() - started
    # ignore_eos: the Engine's decoder stops at the tokenizer's EOS, a bare Decoder knows none.
    outputs, greedy = [], SamplingParams(max_new_tokens=10, ignore_eos=True)
    for bucket in config.buckets:
        sampled = SamplingParams(max_new_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
        variants = [greedy, sampled]
        if args.filtered:
            variants.append(dataclasses.replace(sampled, temperature=1.0, top_k=5, seed=4))
        outputs += [decode(decoder, prompts(bucket), params) for params in variants]
    eager_outputs = []
    if args.mode == "build":
        eager = Decoder(decoder.target, decoder.head, dataclasses.replace(config, compile=False))
        eager_outputs = [decode(eager, prompts(b), greedy) for b in config.buckets]
    steps = {
        name: {"compiles": step.num_compiles, "precompiled_calls": step.num_precompiled_calls}
        for name, step in decoder.compiled_steps().items()
    }
    print(
        json.dumps(
            {
                "outputs": outputs,
                "eager_greedy_outputs": eager_outputs,
                "counters": compile_counters(),
                "steps": steps,
                "ready_s": ready,
                "torch": torch.__version__,
            }
        )
    )


def prompts(bucket: int) -> list[list[int]]:
    return [list(PROMPTS[i % len(PROMPTS)]) for i in range(bucket)]


def decode(decoder: Decoder, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in decoder.stream(prompts, params):
        for slot, (new, _reason) in enumerate(step):
            tokens[slot].extend(new)
    return tokens


if __name__ == "__main__":
    main()
