"""Test helpers: one rank of a tensor-parallel forward, of speculative decoding, of a
`specrun` command started as torchrun starts ranks, and a started rank that dies, on gloo
(importable as `tensor_parallel_worker`, so that torch.multiprocessing can start them in
child processes).

Each rank computes with one thread: the machine's cores are shared by the ranks, whose
collectives wait for each other (oversubscribed, every wait lasts a time slice)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from specrun.models.checkpoint import Checkpoint
from specrun.models.loading import load_draft, load_target
from specrun.models.tensor_parallel import Sharding
from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.tools import cli
from tiny_models import decode_tokens, prompt_logits


def run_rank(rank: int, world_size: int, init_file: str, model_dir: str, ids: list[int]) -> None:
    """Load this rank's shard of `model_dir` (never a whole tensor: Checkpoint.tensors is
    refused) and write its logits of `ids` and the checkpoint bytes it read to
    `model_dir/rank{rank}.pt`."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    num_bytes = []
    slices = Checkpoint.slices

    def counting(self, blocks):
        for name, tensor in slices(self, blocks):
            num_bytes.append(tensor.numel() * tensor.element_size())
            yield name, tensor

    try:
        with (
            mock.patch.object(Checkpoint, "tensors", side_effect=AssertionError("whole read")),
            mock.patch.object(Checkpoint, "slices", counting),
        ):
            model = load_target(model_dir, dtype=torch.float64, sharding=Sharding(rank, world_size))
        logits = prompt_logits(model, ids)
        torch.save(
            {"logits": logits, "num_bytes": sum(num_bytes)}, Path(model_dir) / f"rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


def decode_rank(
    rank: int,
    world_size: int,
    init_file: str,
    model_dir: str,
    head_dir: str,
    config: EngineConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
) -> None:
    """Greedy speculative decoding of `prompts` on this rank's shard with the replicated
    head; writes the tokens to `model_dir/tokens{rank}.pt`."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        target = load_target(model_dir, dtype=torch.float64, sharding=Sharding(rank, world_size))
        head = load_draft(head_dir, target=target)
        params = SamplingParams(max_new_tokens=max_new_tokens)
        tokens, _ = decode_tokens(Decoder(target, head, config), prompts, [params] * len(prompts))
        torch.save(tokens, Path(model_dir) / f"tokens{rank}.pt")
    finally:
        dist.destroy_process_group()


def collectives_rank(
    rank: int, world_size: int, init_file: str, out_dir: str, config, tree
) -> None:
    """Record the collectives of a greedy round of `tree` at bucket 1 on this rank's random
    shard, replay them alone on buffers of ones, and write (op name, shape) of each, the sums
    the all-reduces gave and the rows the all-gather returned to `out_dir/collectives{rank}.pt`."""
    from specrun.runtime.tree import TreeShape  # noqa: F401 (unpickled argument's type)
    from specrun.tools.collectives import CollectiveReplay
    from specrun.tools.decode_bench import round_collectives
    from specrun.tools.random_models import random_eagle3_head, random_target

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(0)
        sharding = Sharding(rank, world_size)
        target = random_target(config, device="cpu", dtype=torch.float32, sharding=sharding)
        head = random_eagle3_head(target, draft_vocab_size=40, dtype=torch.float32, layer=config)
        engine_config = EngineConfig(
            device="cpu", buckets=(1,), trees={1: tree}, max_seq_len=64,
            compile=False, cuda_graphs=False, policy="fixed",
        )  # fmt: skip
        decoder = Decoder(target, head, engine_config)
        variant = decoder.planner.variant_for(1, [SamplingParams()])
        recorded = round_collectives(decoder, 1, variant, context=7)
        outputs = CollectiveReplay(recorded, device="cpu")()
        torch.save(
            {
                "recorded": [(c.name, c.shape) for c in recorded],
                "sums": {out.unique().item() for out in outputs[:-1]},
                "gathered_rows": outputs[-1].shape[0],
            },
            Path(out_dir) / f"collectives{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def bench_decode_rank(ranks, args, shapes) -> None:
    """A rank other than 0 of `bench decode` (tools/decode_cli.py) on the CPU, with `shapes`
    known under `args.shapes` here too."""
    from specrun.tools.decode_cli import decode_points
    from specrun.tools.random_models import SHAPES

    SHAPES[args.shapes] = shapes
    decode_points(args, ranks)


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives one of `world_size` ranks on this host."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def cli_rank(rank: int, world_size: int, port: int, argv: list[str], result: str) -> None:
    """A rank other than 0 of a `specrun` command in torchrun's environment: saves its exit
    status and what it printed to `result`."""
    os.environ.update(torchrun_env(rank, world_size, port))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(argv)
    torch.save((status, out.getvalue()), result)


def exit_rank(ranks, code: int, *, after: float = 0.0) -> None:
    """A started rank (runtime/ranks.py `spawn_ranks` entry) that logs a line, sleeps for
    `after` seconds, then dies with exit code `code` without leaving its groups."""
    logging.getLogger("specrun.tests").info("rank %d leaving", ranks.rank)
    time.sleep(after)
    os._exit(code)


def failing_rank(ranks, message: str) -> None:
    """A started rank whose command raises (as a rank's decoder operation may)."""
    raise RuntimeError(f"rank {ranks.rank}: {message}")
