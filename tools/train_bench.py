"""`specrun bench train-draft`: what `specrun train-draft` costs for a known model's shapes.

With random weights (a forward costs the same whatever their values) the two phases of
train-draft run as they would for the real model:

- answering prompts: `generate_sequences`, the compiled plain decoder at
  `--generate-batch-size` prompts a batch, on random prompts of `--prompt-length` tokens
  (random weights never say EOS, so every answer runs `--max-new-tokens`); timed over the
  chunks after the first, which compiles and captures;
- training: `train_step` on those sequences (the target's forward over the batch, the head
  unrolled `--ttt-steps` times, one AdamW step), timed after `--warmup-steps`, with the peak
  GPU memory of the training phase; with `--profile-steps` (CUDA) that many more steps run
  under the profiler: the kernels a step launches, their summed time, the GPU's idle share
  and the costliest kernels, which say whether a step waits on the host or on the GPU.

The rates give a recipe's time: answering P prompts takes P / prompts-per-second, training
S steps S / steps-per-second (README, "Training a head for your own Llama").
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch

from ..models.config import DRAFT_KINDS, LlamaConfig
from ..runtime.config import EngineConfig
from ..runtime.distill.data import TrainingSequence, generate_sequences
from ..runtime.distill.heads import build_head
from ..runtime.distill.trainer import TrainConfig, new_optimizer, train_step
from .bench_env import environment
from .random_models import SHAPES, random_target
from .round_timing import idle_fraction, kernel_table, profile_kernels


def register(subjects: argparse._SubParsersAction) -> None:
    """The `bench train-draft` sub-command and its options."""
    parser = subjects.add_parser(
        "train-draft", help="train-draft's answering and training rates for a model's shapes"
    )
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--kind", choices=DRAFT_KINDS, default="eagle3")
    parser.add_argument("--prompts", type=int, default=384, help="prompts answered")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--generate-batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed training steps")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument(
        "--draft-vocab", type=int, default=None, help="default: the shapes' EAGLE-3 head's"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=0,
        help="then profile this many more training steps (CUDA): kernels, GPU idle share",
    )  # fmt: skip
    parser.add_argument("--top-kernels", type=int, default=20, help="costliest kernels listed")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--json", default=None, help="also write the JSON line here")
    parser.set_defaults(func=run_train_bench)


def run_train_bench(args: argparse.Namespace) -> int:
    shapes = SHAPES[args.shapes]
    _check_counts(
        num_prompts=args.prompts,
        generate_batch_size=args.generate_batch_size,
        num_steps=args.steps,
        num_warmup_steps=args.warmup_steps,
    )
    engine_config = EngineConfig(device=args.device)
    device = str(engine_config.resolved_device())
    if args.profile_steps < 0 or (args.profile_steps and not device.startswith("cuda")):
        raise ValueError(
            f"--profile-steps profiles CUDA kernels: give a count >= 0 and a CUDA device "
            f"(got {args.profile_steps} on {device})"
        )
    draft_vocab = args.draft_vocab or shapes.draft_vocab_size
    train_config = TrainConfig(
        kind=args.kind,
        num_steps=args.warmup_steps + args.steps,
        batch_size=args.batch_size,
        num_ttt_steps=args.ttt_steps,
        draft_vocab_size=draft_vocab if args.kind == "eagle3" else None,
        max_length=args.max_length,
        num_heldout=0,
    )
    point = train_bench_point(
        shapes.target,
        train_config,
        device=device,
        dtype=engine_config.resolved_dtype(),
        num_prompts=args.prompts,
        prompt_length=args.prompt_length,
        max_new_tokens=args.max_new_tokens,
        generate_batch_size=args.generate_batch_size,
        num_warmup_steps=args.warmup_steps,
        num_profile_steps=args.profile_steps,
        num_top_kernels=args.top_kernels,
    )
    point = {"model": shapes.description + ", random weights"} | point | environment(device)
    line = json.dumps(point)
    print(line)
    if args.json:
        with open(args.json, "w") as sink:
            print(line, file=sink)
    print(summary(point))
    return 0


def _check_counts(
    *, num_prompts: int, generate_batch_size: int, num_steps: int, num_warmup_steps: int
) -> None:
    if generate_batch_size < 1 or num_prompts < 2 * generate_batch_size:
        raise ValueError(
            f"--prompts ({num_prompts}) must be at least twice --generate-batch-size "
            f"({generate_batch_size}): the first batch compiles, the later ones are timed"
        )
    if num_steps < 1 or num_warmup_steps < 0:
        raise ValueError("--steps must be >= 1 and --warmup-steps >= 0")


def train_bench_point(
    target_config: LlamaConfig,
    train_config: TrainConfig,
    *,
    device: str,
    dtype: torch.dtype,
    num_prompts: int,
    prompt_length: int,
    max_new_tokens: int,
    generate_batch_size: int,
    num_warmup_steps: int,
    num_profile_steps: int = 0,
    num_top_kernels: int = 20,
    seed: int = 0,
) -> dict:
    """Answering and training rates of a random target of `target_config`'s shapes (see the
    module docstring); train_config.num_steps counts `num_warmup_steps` and the timed ones."""
    _check_counts(
        num_prompts=num_prompts,
        generate_batch_size=generate_batch_size,
        num_steps=train_config.num_steps - num_warmup_steps,
        num_warmup_steps=num_warmup_steps,
    )
    target = random_target(target_config, device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(
        target_config.vocab_size, (num_prompts, prompt_length), generator=generator
    ).tolist()
    answering = _time_answering(
        target, prompts, max_new_tokens=max_new_tokens, batch_size=generate_batch_size
    )
    training = _time_training(
        target,
        answering.pop("sequences"),
        train_config,
        num_warmup_steps=num_warmup_steps,
        num_profile_steps=num_profile_steps,
        num_top_kernels=num_top_kernels,
    )
    return (
        {
            "prompt_length": prompt_length,
            "max_new_tokens": max_new_tokens,
            "generate_batch_size": generate_batch_size,
            "kind": train_config.kind,
            "train_batch_size": train_config.batch_size,
            "max_length": train_config.max_length,
            "ttt_steps": train_config.num_ttt_steps,
            "draft_vocab": train_config.draft_vocab_size,
            "dtype": str(dtype).removeprefix("torch."),
        }
        | answering
        | training
    )


def _time_answering(
    target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int
) -> dict:
    """Answer `prompts`; the rates count the chunks after the first."""
    ends: list[float] = []
    tokens: list[int] = []

    def chunk_done(chunk: Sequence[TrainingSequence]) -> None:
        ends.append(time.perf_counter())
        tokens.append(sum(len(s.token_ids) - s.num_prompt for s in chunk))

    started = time.perf_counter()
    sequences = generate_sequences(
        target,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        on_chunk=chunk_done,
    )
    timed_seconds = ends[-1] - ends[0]
    num_timed_prompts = len(prompts) - batch_size
    return {
        "sequences": sequences,
        "num_prompts": len(prompts),
        "answer_first_chunk_s": ends[0] - started,
        "answer_tokens_per_s": sum(tokens[1:]) / timed_seconds,
        "answer_prompts_per_s": num_timed_prompts / timed_seconds,
    }


def _time_training(
    target,
    sequences: Sequence[TrainingSequence],
    config: TrainConfig,
    *,
    num_warmup_steps: int,
    num_profile_steps: int = 0,
    num_top_kernels: int = 20,
) -> dict:
    """Run config.num_steps training steps; the rate counts those after the warm-up. Then
    `num_profile_steps` more (the last step's batch again) under the profiler."""
    on_cuda = next(target.parameters()).is_cuda
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    target.requires_grad_(False)
    head = build_head(target, config, sequences)
    optimizer = new_optimizer(head, config)
    head.train()
    try:
        for step in range(num_warmup_steps):
            train_step(head, target, optimizer, sequences, step, config=config)
        started = time.perf_counter()
        for step in range(num_warmup_steps, config.num_steps):
            train_step(head, target, optimizer, sequences, step, config=config)
    except torch.OutOfMemoryError as error:
        raise ValueError(
            f"training batches of {config.batch_size} x {config.max_length} tokens do not fit "
            f"this device beside the target; lower --batch-size or --max-length ({error})"
        ) from error
    seconds = time.perf_counter() - started
    point = {
        "num_sequences": len(sequences),
        "head_params": sum(p.numel() for p in head.parameters()),
        "train_steps": config.num_steps - num_warmup_steps,
        "train_steps_per_s": (config.num_steps - num_warmup_steps) / seconds,
        "train_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None,
    }
    if num_profile_steps == 0:
        return point

    def step() -> None:
        train_step(head, target, optimizer, sequences, config.num_steps - 1, config=config)

    kernels = profile_kernels(step, num_rounds=num_profile_steps, host_loop=False)
    table = kernel_table(kernels, num_rounds=num_profile_steps, top=num_top_kernels)
    return point | {
        "train_profile_steps": num_profile_steps,
        "train_gpu_idle": idle_fraction(kernels),
        "train_kernels_per_step": table["kernels_per_round"],
        "train_kernel_ms_per_step": table["kernel_us_per_round"] / 1e3,
        "train_top_kernels": table["top_kernels"],
    }


def summary(point: dict) -> str:
    """What the rates mean for a run: hours per thousands of prompts and steps."""
    peak = point["train_peak_gib"]
    return (
        f"answering: {point['answer_tokens_per_s']:.0f} response tokens/s, "
        f"{point['answer_prompts_per_s']:.2f} prompts/s at {point['generate_batch_size']} "
        f"a batch ({point['max_new_tokens']} tokens each): "
        f"{1000 / point['answer_prompts_per_s'] / 60:.1f} min per 1000 prompts "
        f"(first batch, compiling: {point['answer_first_chunk_s']:.0f} s)\n"
        f"training ({point['kind']}, batch {point['train_batch_size']} x "
        f"{point['max_length']} tokens, {point['ttt_steps']} draft steps): "
        f"{point['train_steps_per_s']:.2f} steps/s, "
        f"{1000 / point['train_steps_per_s'] / 60:.1f} min per 1000 steps"
        + (f", peak {peak:.1f} GiB" if peak is not None else "")
        + _profile_summary(point)
    )


def _profile_summary(point: dict) -> str:
    """The profiled steps' kernels, time in them against the step's, and the costliest."""
    if "train_profile_steps" not in point:
        return ""
    idle = point["train_gpu_idle"]
    lines = [
        f"\nprofiled step: {point['train_kernels_per_step']:.0f} kernels, "
        f"{point['train_kernel_ms_per_step']:.1f} ms in kernels against "
        f"{1e3 / point['train_steps_per_s']:.1f} ms a step"
        + (f", GPU idle {idle:.0%} of the profiled span" if idle is not None else "")
    ]
    for name, launches, micros in point["train_top_kernels"]:
        lines.append(f"  {micros / 1e3:8.2f} ms {launches:6.0f}x  {name}")
    return "\n".join(lines)
