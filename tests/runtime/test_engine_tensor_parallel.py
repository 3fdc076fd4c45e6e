"""A tensor-parallel Engine on the CPU: `EngineConfig(tensor_parallel=2)` starts a second rank
process (gloo), whose decoder replays rank 0's commands; after a warm-up that measures every
round, greedy outputs equal the single-process engine's token for token through admissions,
chunked prefills, cancellations and moves under the `cost` policy (whose choices rank 0 alone
makes); under torchrun's environment `specrun generate --tp 2` prints what one process
prints; the rank process exits when the engine closes or its process dies; configurations
that cannot run are refused before any process starts."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tensor_parallel_worker import cli_rank, torchrun_env
from tokenizers import Tokenizer, models, pre_tokenizers

from specrun.models.loading import save_draft, save_target
from specrun.runtime import Engine, EngineConfig, SamplingParams
from specrun.runtime.tree import TreeShape
from specrun.tools import cli
from tiny_models import random_head, random_llama, tiny_config

CONFIG = EngineConfig(
    device="cpu",
    dtype="float32",
    buckets=(1, 2, 4),
    trees={1: TreeShape(3, 3, 8), 4: TreeShape(2, 2, 4)},
    max_seq_len=128,
    max_prefill_tokens=12,
    policy="cost",
)
# Six requests for four slots: the last two wait and are admitted into the running batch;
# the third (20 tokens, over max_prefill_tokens) is prefilled in chunks; the fourth outlives
# the others, so its slot moves down once it decodes alone.
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], list(range(10, 30)), [40, 41], [50, 51, 52], [60]]
PARAMS = [SamplingParams(max_new_tokens=n) for n in (8, 4, 6, 24, 5, 4)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny float32 target (4 heads, 2 KV heads, vocabulary 98) with a word-level
    tokenizer, and a random EAGLE-3 head: (model dir, head dir)."""
    out = tmp_path_factory.mktemp("tensor-parallel-engine")
    config = tiny_config(vocab_size=98, num_heads=4, num_kv_heads=2)
    target = random_llama(config, seed=5)
    model_dir = save_target(target, out / "model")
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    head_dir = save_draft(random_head("eagle3", target, seed=6), out / "head")
    return model_dir, head_dir


@pytest.fixture(scope="module")
def want(model_dirs) -> list[list[int]]:
    """The single-process engine's tokens of PROMPTS."""
    model_dir, head_dir = model_dirs
    with one_thread(), Engine.from_pretrained(model_dir, draft=head_dir, config=CONFIG) as single:
        return [out.token_ids for out in single.generate(PROMPTS, PARAMS)]


@contextlib.contextmanager
def one_thread():
    """Compute with one thread, as each of two ranks does on a 2-core machine (a tiny
    model's rounds are many small ops, which more threads only slow down)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_two_ranks_decode_the_single_process_engines_tokens(model_dirs, want):
    model_dir, head_dir = model_dirs
    config = dataclasses.replace(CONFIG, tensor_parallel=2)
    engine = Engine.from_pretrained(model_dir, draft=head_dir, config=config)
    workers = list(engine._ranks.workers)
    assert [w.is_alive() for w in workers] == [True]
    # Count the commands rank 0 broadcasts.
    commands, run = collections.Counter(), engine.decoder._run
    engine.decoder._run = lambda name, *args, **kwargs: (
        commands.update([name]) or run(name, *args, **kwargs)
    )
    try:
        # Every rank prepares every round; rank 0's timings seed its cost table.
        engine.warmup(progress=False)
        planner = engine.decoder.planner
        assert all(planner.costs.get(b, planner.variants(b)[0].cost_key) for b in CONFIG.buckets)
        got = [out.token_ids for out in engine.generate(PROMPTS, PARAMS)]
        assert got == want
        # A request cancelled mid-stream releases its slot on both ranks.
        stream = engine.stream([70, 71, 72], SamplingParams(max_new_tokens=60))
        next(stream)
        stream.close()
        assert [out.token_ids for out in engine.generate(PROMPTS[:2], PARAMS[:2])] == want[:2]
    finally:
        engine.close()
    for name in ("admit", "start_chunked_prefill", "prefill_chunk", "release", "move", "round"):
        assert commands[name] > 0, (name, commands)
    assert commands["close"] == 1
    assert not any(w.is_alive() for w in workers)
    assert not multiprocessing.active_children()
    engine.close()  # closing again is harmless


def test_specrun_generate_under_torchrun(model_dirs, monkeypatch, capsys):
    """`torchrun --nproc-per-node 2 ... specrun generate --tp 2` (rank 0 is this process,
    rank 1 a process in torchrun's environment): every rank runs the command and calls
    Engine.from_pretrained, rank 0 gets the engine and prints the single-process text, rank 1
    serves it, returns None once rank 0 has closed it, and prints nothing."""
    model_dir, head_dir = model_dirs
    argv = ["generate", "t5 t6 t7 t8", "--model", str(model_dir), "--draft", str(head_dir)]
    argv += ["--device", "cpu", "--dtype", "float32", "--raw", "--max-new-tokens", "12"]
    with one_thread():
        assert cli.main(argv) == 0
    single = capsys.readouterr().out
    assert len(single.split()) == 12
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in torchrun_env(0, 2, port).items():
        monkeypatch.setenv(name, value)
    argv += ["--tp", "2"]
    result = model_dir / "rank1.pt"
    follower = mp.get_context("spawn").Process(
        target=cli_rank, args=(1, 2, port, argv, str(result))
    )
    follower.start()
    try:
        assert cli.main(argv) == 0
        follower.join(60)
    finally:
        follower.kill()
    assert capsys.readouterr().out == single
    assert follower.exitcode == 0
    assert torch.load(result) == (0, "")
    assert not torch.distributed.is_initialized()


# A process that starts a tensor-parallel engine, prints its rank process's pid and dies
# without closing it.
DYING_PARENT = """
import os, sys
from specrun.runtime import Engine, EngineConfig
config = EngineConfig(device="cpu", dtype="float32", buckets=(1,), tensor_parallel=2)
engine = Engine.from_pretrained(sys.argv[1], draft=sys.argv[2], config=config)
print(engine._ranks.workers[0].pid, flush=True)
os._exit(1)
"""


def test_the_rank_process_exits_when_the_engines_process_dies(model_dirs):
    model_dir, head_dir = model_dirs
    done = subprocess.run(
        [sys.executable, "-c", DYING_PARENT, str(model_dir), str(head_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def test_configurations_that_cannot_run_are_refused_before_starting_ranks(model_dirs):
    model_dir, head_dir = model_dirs
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(tensor_parallel=0)
    with pytest.raises(TypeError, match="tensor_parallel must be an int"):
        EngineConfig(tensor_parallel=2.0)
    for tensor_parallel in (3, 4):  # 3 divides nothing; 4 does not divide 2 KV heads
        config = dataclasses.replace(CONFIG, tensor_parallel=tensor_parallel)
        with pytest.raises(ValueError, match=r"tensor_parallel=.*num_key_value_heads=2"):
            Engine.from_pretrained(model_dir, draft=head_dir, config=config)
    config = dataclasses.replace(CONFIG, tensor_parallel=2, device="cuda:1")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        Engine.from_pretrained(model_dir, draft=head_dir, config=config)
    with pytest.raises(ValueError, match="artifacts"):
        Engine.from_pretrained(
            model_dir, config=dataclasses.replace(CONFIG, tensor_parallel=2), artifacts=model_dir
        )
    assert not multiprocessing.active_children()
