"""What `specrun bench decode --tp N` measures besides time, on the CPU with gloo: a rank's
random shard is built in place at its shard's size and dtype (a 70B rank could hold nothing
more); the collectives a plain step and a speculative round launch, counted and sized from an
eager run; their replay alone launches the same collectives on every rank; and the tables
that report the floor and the collectives' share."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensor_parallel_worker import bench_decode_rank, collectives_rank
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specrun.models.llama import Llama
from specrun.models.tensor_parallel import Sharding, shard_slices
from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.ranks import spawn_ranks
from specrun.runtime.tree import TreeShape
from specrun.tools import kernel_bench
from specrun.tools.cli import build_parser
from specrun.tools.collectives import CollectiveReplay, count_collectives, record_collectives
from specrun.tools.decode_bench import round_collectives
from specrun.tools.decode_cli import decode_points, format_tables
from specrun.tools.random_models import (
    SHAPES,
    BenchShapes,
    random_eagle3_head,
    random_target,
    weight_bytes,
)
from tiny_models import tiny_config

CONFIG = tiny_config(vocab_size=98, num_layers=3)
TREE = TreeShape(depth=3, topk=2, num_nodes=5)


class _Allocations(TorchDispatchMode):
    """Every tensor an op returns off the meta device: (number of elements, dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self.made.append((leaf.numel(), leaf.dtype))
        return out


def test_a_rank_builds_only_its_shard_in_place_and_in_its_dtype():
    """Rank 1 of 2 (no process group is needed to build): its parameters are exactly its
    blocks of the unsharded checkpoint (`shard_slices`), in bfloat16; no op ever made a
    tensor larger than its largest parameter (the fused gate/up block), nor a float32 one
    larger than the rotary tables (a frequency and a sign per column of a head)."""
    sharding = Sharding(1, 2)
    allocations = _Allocations()
    with allocations:
        model = random_target(CONFIG, device="cpu", dtype=torch.bfloat16, sharding=sharding)
    with torch.device("meta"):
        whole = Llama(CONFIG).state_dict()
    blocks = [
        torch.empty(tuple(whole[name].shape), device="meta")[
            shard_slices(name, tuple(whole[name].shape), sharding)
        ].numel()
        for name in whole
    ]
    params = list(model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.device.type for p in params} == {"cpu"}
    assert sum(p.numel() for p in params) == sum(blocks)
    largest = max(p.numel() for p in params)
    assert largest == 2 * (CONFIG.intermediate_size // 2) * CONFIG.hidden_size
    assert max(numel for numel, _ in allocations.made) == largest
    float32 = [numel for numel, dtype in allocations.made if dtype == torch.float32]
    assert max(float32) <= CONFIG.head_dim


def test_the_70b_shapes_shard_over_two_ranks_at_the_published_size():
    """Llama-3.1-70B over two ranks, built on the meta device: 35.3 billion parameters per
    rank (70.6 GB in bfloat16, of which 69.5 GB a plain step reads), the 70B config's
    intermediate size and 80 layers; the replicated EAGLE-3 head has the unsharded layer."""
    config = SHAPES["llama-3.1-70b"].target
    assert (config.num_layers, config.intermediate_size, config.rope_scaling.factor) == (
        80,
        28672,
        8.0,
    )
    shard = random_target(config, device="meta", dtype=torch.bfloat16, sharding=Sharding(0, 2))
    head = random_eagle3_head(shard, draft_vocab_size=32000, dtype=torch.bfloat16, layer=config)
    num_params = sum(p.numel() for p in shard.parameters())
    assert num_params == pytest.approx(35.3e9, rel=0.01)
    assert weight_bytes(shard) == pytest.approx(69.5e9, rel=0.01)
    assert head.midlayer.mlp.down_proj.weight.shape == (8192, 28672)
    assert sum(p.numel() for p in head.parameters()) == pytest.approx(1.40e9, rel=0.01)


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone: collectives run, over one rank."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _decoder(tree: TreeShape | None, *, bucket: int = 2) -> Decoder:
    torch.manual_seed(0)
    target = random_target(CONFIG, device="cpu", dtype=torch.float32, sharding=Sharding(0, 1))
    head = random_eagle3_head(target, draft_vocab_size=40, dtype=torch.float32)
    config = EngineConfig(
        device="cpu", buckets=(bucket,), trees={bucket: tree}, max_seq_len=64,
        compile=False, cuda_graphs=False, policy="fixed",
    )  # fmt: skip
    return Decoder(target, head if tree is not None else None, config)


@pytest.mark.parametrize("tree", [None, TREE], ids=["plain", "round"])
def test_a_round_launches_an_all_reduce_per_embedding_and_two_per_layer(one_rank_group, tree):
    """A plain step: the embedding's all-reduce, two per layer, the logits' all-gather. A
    round: the same over the tree's N tokens, plus the draft head's D embedding lookups (it
    borrows the target's vocabulary-parallel embedding). The replay launches the same."""
    bucket, hidden, num_layers = 2, CONFIG.hidden_size, CONFIG.num_layers
    decoder = _decoder(tree, bucket=bucket)
    variant = decoder.planner.variant_for(bucket, [SamplingParams()])
    recorded = round_collectives(decoder, bucket, variant, context=7)
    num_tokens = 1 if tree is None else tree.num_nodes
    num_draft = 0 if tree is None else tree.depth
    assert count_collectives(recorded) == {
        "all_reduce": num_draft + 1 + 2 * num_layers,
        "all_gather_into_tensor": 1,
    }
    verify = recorded[num_draft:]
    assert {c.shape for c in verify[:-1]} == {(bucket, num_tokens, hidden)}
    # A plain step's logits are the root's alone: [vocab, B] gathered; a round's [vocab, B, N].
    logits = (bucket,) if tree is None else (bucket, num_tokens)
    assert verify[-1].shape == (CONFIG.vocab_size, *logits)
    assert {c.dtype for c in recorded} == {torch.float32}
    replayed = record_collectives(CollectiveReplay(recorded, device="cpu"))
    # The same collectives, the all-reduces in place.
    assert [(c.name.rstrip("_"), c.shape, c.dtype, c.args) for c in replayed] == [
        (c.name, c.shape, c.dtype, c.args) for c in recorded
    ]


def test_two_ranks_replay_the_rounds_collectives_alike():
    """Over two gloo ranks each records the round's collectives at its shard's sizes (the
    gathered logits: half the vocabulary per rank) and the replay runs them together."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "init")
        mp.spawn(collectives_rank, args=(2, init_file, tmp, CONFIG, TREE), nprocs=2)
        results = [torch.load(Path(tmp) / f"collectives{r}.pt") for r in range(2)]
    assert results[0]["recorded"] == results[1]["recorded"]
    for result in results:
        gather = result["recorded"][-1]
        assert gather[0] == "all_gather_into_tensor"
        assert gather[1] == (CONFIG.vocab_size // 2, 1, TREE.num_nodes)
        assert len(result["recorded"]) == TREE.depth + 2 + 2 * CONFIG.num_layers
        # Replayed on buffers of ones: every all-reduce sums two, the gather doubles rows.
        assert result["sums"] == {2.0}
        assert result["gathered_rows"] == CONFIG.vocab_size


def test_bench_decode_runs_over_two_gloo_ranks(monkeypatch, tmp_path, capsys):
    """`bench decode --tp 2 --no-compile` end to end on the CPU (eager rounds, no graphs, the
    host clock): both ranks run the same points, rank 0 writes one JSON line per point with
    its collectives and floor, and prints the tables."""
    shapes = BenchShapes("tiny shapes", CONFIG, 40)
    monkeypatch.setitem(SHAPES, "tiny", shapes)
    monkeypatch.setattr(kernel_bench, "copy_bandwidth", lambda **_: 1e9)
    # The command line's own parser (built once "tiny" is a shape), so every option is set.
    args = build_parser().parse_args(
        ["bench", "decode", "--shapes", "tiny", "--buckets", "1", "2", "--context", "7",
         "--rounds", "2", "--tree", "3", "2", "5", "--top-kernels", "5", "--no-compile",
         "--tp", "2", "--json", str(tmp_path / "points.jsonl")]
    )  # fmt: skip
    ranks = spawn_ranks(2, device_type="cpu", entry=bench_decode_rank, args=(args, shapes))
    try:
        assert decode_points(args, ranks) == 0
    finally:
        ranks.close()
    points = [json.loads(line) for line in Path(args.json).read_text().splitlines()]
    assert [(p["bucket"], p["mode"]) for p in points] == [
        (1, "plain"), (1, "speculative"), (2, "plain"), (2, "speculative"),
    ]  # fmt: skip
    num_layers = CONFIG.num_layers
    for point in points:
        num_draft = 3 if point["mode"] == "speculative" else 0
        assert point["collectives"] == {
            "all_reduce": num_draft + 1 + 2 * num_layers,
            "all_gather_into_tensor": 1,
        }
        assert point["execution"] == "eager" and point["tensor_parallel"] == 2
        assert point["collectives_ms"] > 0 and point["collectives_share"] > 0
        if num_draft:  # the draft phase alone, in the round's unit (not a thousandth of it)
            assert point["round_ms"] / 50 < point["draft_ms"]
            assert point["verify_ms"] == pytest.approx(point["round_ms"] - point["draft_ms"])
    plain = points[0]  # at 1 GB/s, a GB of weights reads in a second
    assert plain["weight_floor_ms"] == pytest.approx(
        plain["weight_gb"] * 1e3 + plain["collectives_ms"], rel=1e-6
    )
    captured = capsys.readouterr()
    assert "eagerly" in captured.out and "floor = weights" in captured.out
    assert "B=1 plain: " in captured.err and "B=2 speculative tree 3,2,5: " in captured.err


def _point(mode: str, round_ms: float, **fields) -> dict:
    point = {
        "bucket": 1, "mode": mode, "tree": None, "stochastic": False, "round_ms": round_ms,
        "warmup_s": 1.0, "graph_pool_mib": 2.0, "gpu_idle": None, "weight_gb": 70.6,
        "collectives": {"all_reduce": 161, "all_gather_into_tensor": 1},
        "collectives_ms": 2.0, "collectives_share": 2.0 / round_ms,
    }  # fmt: skip
    return point | fields


def test_the_tables_give_the_floor_and_the_collectives_share():
    plain = _point(
        "plain", 20.0, tokens_per_s=50.0, floor_fraction=0.9, weight_floor_ms=18.0,
        weight_floor_fraction=0.9,
    )  # fmt: skip
    spec = _point("speculative", 26.0, tree=[7, 10, 60], draft_ms=5.0, verify_ms=21.0)
    text = format_tables([plain, spec], accept_length=5.39, execution="eager")
    assert "eagerly" in text
    # B, GB/GPU, plain ms, floor ms, of floor, the plain step's collectives (count, ms,
    # share), round ms, the round's collectives, round / plain.
    assert text.splitlines()[-1].split() == [
        "1", "70.60", "20.00", "18.00", "90.0%", "162", "2.00", "10.0%",
        "26.00", "162", "2.00", "7.7%", "1.30",
    ]  # fmt: skip
