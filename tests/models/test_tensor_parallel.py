"""Tensor-parallel Llama shards (models/tensor_parallel.py) on the CPU with gloo: two ranks'
forward equals the unsharded model's, each rank reading only its blocks of the checkpoint;
two ranks decoding speculatively (a replicated head, the same deterministic loop on every
rank) emit the reference's tokens; shapes that do not divide are refused."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tensor_parallel_worker import decode_rank, run_rank

from specrun.models.loading import load_draft, load_target, save_draft, save_target
from specrun.models.tensor_parallel import Sharding, local_config, shard_slices
from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.reference import reference_generate
from specrun.runtime.tree import TreeShape
from tiny_models import decode_tokens, prompt_logits, random_head, random_llama, tiny_config

WORLD_SIZE = 2


@st.composite
def sharded_configs(draw):
    """Tiny configs whose heads, KV heads, MLP width and vocabulary divide by two: GQA and
    not, tied or not, with biases or not."""
    num_kv_heads = draw(st.sampled_from([2, 4]))
    return tiny_config(
        vocab_size=2 * draw(st.integers(40, 60)),
        num_heads=num_kv_heads * draw(st.sampled_from([1, 2])),
        num_kv_heads=num_kv_heads,
        intermediate_size=2 * draw(st.integers(16, 40)),
        num_layers=draw(st.integers(1, 3)),
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
    )


# Each example starts two processes: a few examples, no shrinking.
@settings(
    max_examples=3,
    deadline=None,
    phases=[Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(config=sharded_configs(), seed=st.integers(0, 99))
def test_two_ranks_compute_the_unsharded_logits_reading_only_their_blocks(config, seed):
    model = random_llama(config, seed=seed, dtype=torch.float64)
    ids = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(seed))
    with tempfile.TemporaryDirectory() as tmp:
        save_target(model, tmp)
        want = prompt_logits(load_target(tmp, dtype=torch.float64), ids.tolist())
        init_file = str(Path(tmp) / "init")
        mp.spawn(run_rank, args=(WORLD_SIZE, init_file, tmp, ids.tolist()), nprocs=WORLD_SIZE)
        results = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    full_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for result in results:
        torch.testing.assert_close(result["logits"], want, rtol=1e-10, atol=1e-10)
        # Norms are replicated; every projection, the embedding and the head are halved.
        assert result["num_bytes"] < 0.6 * full_bytes


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_two_ranks_decode_speculatively_to_the_reference(kind, tmp_path):
    """Every rank runs the same loop (the `fixed` policy: no choice rests on a rank's own
    timings) over replicated hidden states and gathered logits, so every rank accepts the
    same drafts; greedy output equals unsharded speculative decoding and the reference."""
    config = tiny_config(vocab_size=98, num_heads=4, num_kv_heads=2)
    model = random_llama(config, seed=3, dtype=torch.float64)
    model_dir, head_dir = tmp_path / "target", tmp_path / "head"
    save_target(model, model_dir)
    target = load_target(model_dir, dtype=torch.float64)
    save_draft(random_head(kind, target, seed=4), head_dir)
    head = load_draft(head_dir, target=target)
    engine_config = EngineConfig(
        device="cpu",
        buckets=(1, 2),
        trees={1: TreeShape(4, 3, 10), 2: TreeShape(3, 2, 6)},
        max_seq_len=96,
        policy="fixed",
    )
    prompts, max_new_tokens = [[5, 6, 7, 8, 9], [1, 2, 3]], 24
    params = [SamplingParams(max_new_tokens=max_new_tokens)] * len(prompts)
    unsharded, _ = decode_tokens(Decoder(target, head, engine_config), prompts, params)
    assert unsharded == [r.token_ids for r in reference_generate(target, prompts, params)]
    args = (
        WORLD_SIZE,
        str(tmp_path / "init"),
        str(model_dir),
        str(head_dir),
        engine_config,
        prompts,
        max_new_tokens,
    )
    mp.spawn(decode_rank, args=args, nprocs=WORLD_SIZE)
    for rank in range(WORLD_SIZE):
        assert torch.load(model_dir / f"tokens{rank}.pt") == unsharded


def test_shapes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        local_config(tiny_config(num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="vocab_size=97"):
        local_config(tiny_config(), 2)
    local = local_config(tiny_config(vocab_size=98), 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 32)
    assert local.vocab_size == 98 and local.hidden_size == 32
    with pytest.raises(ValueError, match="rank must be in"):
        Sharding(2, 2)


def test_blocks_follow_the_megatron_layout():
    sharding = Sharding(1, 2)
    assert shard_slices("layers.0.self_attn.q_proj.weight", (8, 4), sharding)[0] == slice(4, 8)
    assert shard_slices("layers.0.mlp.up_proj.bias", (6,), sharding) == (slice(3, 6),)
    assert shard_slices("layers.0.mlp.down_proj.weight", (4, 6), sharding) == (
        slice(None),
        slice(3, 6),
    )
    assert shard_slices("layers.0.self_attn.o_proj.bias", (4,), sharding) == (slice(None),)
    assert shard_slices("embed_tokens.weight", (10, 4), sharding)[0] == slice(5, 10)
    assert shard_slices("norm.weight", (4,), sharding) == (slice(None),)
    config = dataclasses.replace(tiny_config(vocab_size=98), num_layers=1)
    assert local_config(config, 1) == config
