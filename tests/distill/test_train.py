"""Online distillation of draft heads on a tiny target: the training-time-test unroll is the
inference computation, losses fall, heads round-trip through save/load, resume is exact."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from specrun.models.attention import chain_ancestors
from specrun.models.llama import AttentionInputs
from specrun.models.loading import check_vocab_maps, load_draft, save_draft
from specrun.runtime.config import SamplingParams
from specrun.runtime.distill.data import (
    TrainingSequence,
    draft_vocab,
    generate_sequences,
    load_sequences,
    make_batch,
    token_frequencies,
)
from specrun.runtime.distill.heads import initial_head
from specrun.runtime.distill.losses import first_features, run_target, unroll
from specrun.runtime.distill.trainer import (
    TrainConfig,
    heldout_agreement,
    split_heldout,
    train_draft,
)
from specrun.runtime.kv_cache import KVCache
from specrun.runtime.reference import reference_generate
from specrun.runtime.speculative import speculative_generate
from specrun.runtime.tree import TreeShape
from tiny_models import random_head, random_llama, tiny_config


@pytest.fixture(scope="module")
def target():
    return random_llama(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def sequences(target) -> list[TrainingSequence]:
    """Greedy self-distilled responses to 48 random prompts."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(97, (3 + i % 5,), generator=generator).tolist() for i in range(48)]
    return generate_sequences(target, prompts, max_new_tokens=24, temperature=0.0)


def _train(target, sequences, tmp_path, **overrides):
    fields = {
        "num_steps": 40,
        "batch_size": 8,
        "lr": 3e-3,
        "num_ttt_steps": 3,
        "eval_interval": 20,
        "checkpoint_interval": 20,
        "num_heldout": 6,
    }
    config = TrainConfig(**(fields | overrides))
    return train_draft(target, sequences, config=config, out_dir=tmp_path, progress=False)


def _mean(values):
    return sum(values) / len(values)


def _inference_chain(head, tokens, features, *, position: int, num_steps: int):
    """Hidden states [num_steps, H] of a chain draft grown from committed prefix 0..position
    the way the runtime runs it: prefix pairs in the draft cache, chain nodes in a side buffer."""
    layer = head.config.layer
    cache = KVCache.allocate(layer, num_layers=head.num_layers, batch_size=1, capacity=64,
                             dtype=features.dtype, device="cpu")  # fmt: skip
    if position > 0:
        anc = chain_ancestors(1, position, "cpu")
        pos = torch.arange(position)[None]
        out = head(tokens[:, 1 : position + 1], features[:, :position], pos,
                   cache.attention_inputs(anc))  # fmt: skip
        cache.append(out.k_new, out.v_new, torch.tensor([position]))
    hiddens, k_side, v_side = [], None, None
    feature = features[:, position : position + 1]
    for step in range(num_steps):
        anc = chain_ancestors(1, step + 1, "cpu")[:, -1:]
        attn = AttentionInputs(cache.k, cache.v, cache.lengths, anc, k_side, v_side)
        token = tokens[:, position + 1 + step : position + 2 + step]
        out = head(token, feature, torch.tensor([[position + step]]), attn)
        k_side = out.k_new if k_side is None else torch.cat([k_side, out.k_new], dim=3)
        v_side = out.v_new if v_side is None else torch.cat([v_side, out.v_new], dim=3)
        feature = out.hidden
        hiddens.append(out.hidden[0, 0])
    return torch.stack(hiddens)


@pytest.mark.parametrize(("kind", "num_layers"), [("eagle3", 1), ("eagle3", 2), ("eagle1", 1)])
def test_training_time_test_is_the_inference_computation(kind, num_layers):
    target = random_llama(tiny_config(), seed=3, dtype=torch.float64)
    head = random_head(kind, target, seed=4, num_layers=num_layers)
    tokens = torch.randint(97, (1, 12), generator=torch.Generator().manual_seed(5))
    num_steps = 4
    with torch.no_grad():
        features = first_features(head, run_target(target, tokens))
        unrolled = [out.hidden[0] for out in unroll(head, tokens, features, num_steps=num_steps)]
        for position in (0, 3, 7):
            expected = _inference_chain(
                head, tokens, features, position=position, num_steps=num_steps
            )
            got = torch.stack([hidden[position] for hidden in unrolled])
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_eagle3_loss_falls_and_the_head_round_trips(target, sequences, tmp_path):
    result = _train(target, sequences, tmp_path, kind="eagle3", draft_vocab_size=48)
    assert _mean(result.losses[-5:]) < 0.6 * _mean(result.losses[:5])
    first, last = result.heldout[0][1], result.heldout[-1][1]
    assert last[0] > first[0] - 0.05
    loaded = load_draft(tmp_path, target=target)
    trained = result.head.state_dict()
    assert set(loaded.state_dict()) == set(trained)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    tokens = make_batch(sequences[:2], max_length=64).tokens
    with torch.no_grad():
        features = first_features(loaded, run_target(target, tokens))
        ours = next(unroll(result.head, tokens, features, num_steps=1))
        theirs = next(unroll(loaded, tokens, features, num_steps=1))
    assert torch.equal(ours.logits, theirs.logits)


def test_two_layer_eagle3_loss_falls_and_the_head_round_trips(target, sequences, tmp_path):
    result = _train(target, sequences, tmp_path, kind="eagle3", num_layers=2,
                    draft_vocab_size=48, num_steps=8, eval_interval=8)  # fmt: skip
    assert result.head.num_layers == 2
    assert _mean(result.losses[-3:]) < 0.9 * _mean(result.losses[:3])
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 2
    loaded = load_draft(tmp_path, target=target)
    trained = result.head.state_dict()
    assert loaded.num_layers == 2 and set(loaded.state_dict()) == set(trained)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_generated_sequences_are_the_reference_greedy_responses(target):
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(97, (2 + i,), generator=generator).tolist() for i in range(5)]
    # Batches of 4: the second one holds a single prompt and three padding slots.
    sequences = generate_sequences(target, prompts, max_new_tokens=9, batch_size=4)
    expected = reference_generate(target, prompts, SamplingParams(max_new_tokens=9))
    for prompt, seq, ref in zip(prompts, sequences, expected, strict=True):
        assert seq.num_prompt == len(prompt)
        assert list(seq.token_ids) == [*prompt, *ref.token_ids]


def test_head_saved_in_bf16_shards_round_trips(target, sequences, tmp_path):
    result = _train(target, sequences, tmp_path, kind="eagle3", draft_vocab_size=48, num_steps=1)
    out = tmp_path / "shipped"
    save_draft(result.head, out, dtype=torch.bfloat16, max_shard_bytes=4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    state = {
        n: t.to(torch.bfloat16) if t.is_floating_point() else t
        for n, t in result.head.state_dict().items()
    }
    for shard in shards:
        names = [n for n, f in index["weight_map"].items() if f == shard]
        num_bytes = sum(state[n].numel() * state[n].element_size() for n in names)
        assert num_bytes <= 4096 or len(names) == 1, (shard, names, num_bytes)
    loaded = load_draft(out, target=target)
    for name, tensor in result.head.state_dict().items():
        saved = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(loaded.state_dict()[name].to(saved.dtype), saved), name


def test_a_head_trains_against_a_bf16_target_on_the_cpu(sequences, tmp_path):
    """The CPU loads targets in bf16 by default: the float32 head meets its bf16 taps and
    embeddings under autocast, and the loss still falls."""
    target = random_llama(tiny_config(), seed=0, dtype=torch.bfloat16)
    result = _train(target, sequences, tmp_path, kind="eagle3", draft_vocab_size=48)
    assert all(math.isfinite(loss) for loss in result.losses)
    assert _mean(result.losses[-5:]) < 0.8 * _mean(result.losses[:5])
    assert next(result.head.parameters()).dtype == torch.float32


def test_trained_eagle3_vocab_is_consistent(target, sequences, tmp_path):
    result = _train(target, sequences, tmp_path, kind="eagle3", draft_vocab_size=32, num_steps=2)
    head = result.head
    check_vocab_maps(head)
    draft_ids = torch.arange(32)
    mapped = head.to_target_ids(draft_ids)
    assert bool(head.t2d[mapped].all()) and int(head.t2d.sum()) == 32
    assert bool((mapped[1:] > mapped[:-1]).all())
    train_set, _ = split_heldout(sequences, config=TrainConfig(num_heldout=6))
    counts = token_frequencies(train_set, vocab_size=97)
    most_frequent = counts.argsort(descending=True, stable=True)[:8]
    assert bool(head.t2d[most_frequent].all())


def test_draft_vocab_keeps_the_most_frequent_ids():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = draft_vocab(counts, size=3)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]
    assert t2d.tolist() == [False, False, True, True, False, True]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        draft_vocab(counts, size=7)


def test_eagle1_loss_falls(target, sequences, tmp_path):
    result = _train(target, sequences, tmp_path, kind="eagle1", num_ttt_steps=1)
    assert _mean(result.losses[-5:]) < 0.8 * _mean(result.losses[:5])
    loaded = load_draft(tmp_path, target=target)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, result.head.state_dict()[name]), name


def test_trained_head_speculates_losslessly(target, sequences, tmp_path):
    _train(target, sequences, tmp_path, kind="eagle3", draft_vocab_size=48, num_steps=10)
    head = load_draft(tmp_path, target=target)
    prompts = [list(s.token_ids[: s.num_prompt]) for s in sequences[:3]]
    params = SamplingParams(max_new_tokens=12)
    shape = TreeShape(depth=3, topk=2, num_nodes=6)
    spec, _ = speculative_generate(target, head, prompts, params, shape=shape)
    plain = reference_generate(target, prompts, params)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]


@pytest.mark.parametrize("length_groups", [1, 4])
def test_resume_continues_at_the_saved_step(target, sequences, tmp_path, length_groups):
    overrides = {"kind": "eagle3", "draft_vocab_size": 48, "num_steps": 6, "checkpoint_interval": 3,
                 "length_groups": length_groups}  # fmt: skip
    whole = _train(target, sequences, tmp_path / "whole", **overrides)
    config = TrainConfig(**({"batch_size": 8, "lr": 3e-3, "num_ttt_steps": 3,
                             "eval_interval": 20, "num_heldout": 6} | overrides))  # fmt: skip
    first = train_draft(target, sequences, config=config, out_dir=tmp_path / "cut", stop_at=3,
                        progress=False)  # fmt: skip
    assert len(first.losses) == 3
    state = torch.load(tmp_path / "cut" / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 3
    rest = train_draft(target, sequences, config=config, out_dir=tmp_path / "cut", resume=True,
                       progress=False)  # fmt: skip
    assert rest.losses == whole.losses[3:]
    for name, tensor in rest.head.state_dict().items():
        assert torch.equal(tensor, whole.head.state_dict()[name]), name


def test_resume_with_another_draft_vocabulary_says_which_option_to_repeat(
    target, sequences, tmp_path
):
    config = TrainConfig(kind="eagle3", draft_vocab_size=48, num_steps=4, batch_size=4,
                         num_ttt_steps=2, num_heldout=2)  # fmt: skip
    train_draft(target, sequences, config=config, out_dir=tmp_path, stop_at=2, progress=False)
    other = dataclasses.replace(config, draft_vocab_size=40)
    with pytest.raises(ValueError, match=r"lm_head.weight \[48, .*--draft-vocab"):
        train_draft(target, sequences, config=other, out_dir=tmp_path, resume=True, progress=False)


def test_a_head_fine_tuned_from_a_trained_one_starts_where_it_ended(target, sequences, tmp_path):
    trained = _train(target, sequences, tmp_path / "first")
    config = TrainConfig(num_steps=2, batch_size=8, lr=1e-9, num_ttt_steps=3, num_heldout=6)
    tuned = train_draft(
        target,
        sequences,
        config=config,
        out_dir=tmp_path / "tuned",
        progress=False,
        init_from=tmp_path / "first",
    )
    fresh = _train(target, sequences, tmp_path / "fresh", num_steps=2, lr=1e-9)
    # The loss picks up near where the first run ended, far below a fresh head's.
    assert tuned.losses[0] < 0.5 * fresh.losses[0]
    assert abs(tuned.losses[0] - trained.losses[-1]) < 0.5 * fresh.losses[0]
    before, after = trained.head.state_dict(), tuned.head.state_dict()
    assert set(before) == set(after)
    for name, tensor in after.items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=1e-5, msg=name)


def test_a_given_heldout_set_is_measured_before_and_after_a_fine_tune(target, sequences, tmp_path):
    """With `heldout`, every sequence trains and the agreement is over that set; a fine-tune
    measures its starting head first, which is the figure the run that wrote it ended on."""
    heldout, train_set = sequences[:6], sequences[6:]
    config = TrainConfig(num_steps=4, batch_size=8, lr=3e-3, num_ttt_steps=3, num_heldout=6,
                         eval_interval=2)  # fmt: skip
    first = train_draft(target, train_set, config=config, out_dir=tmp_path / "first",
                        progress=False, save_dtype=torch.float32, heldout=heldout)  # fmt: skip
    assert [step for step, _ in first.heldout] == [2, 4]
    assert split_heldout(train_set, config=config, heldout=heldout) == (train_set, heldout)
    tuned = train_draft(target, train_set, config=config, out_dir=tmp_path / "tuned",
                        progress=False, init_from=tmp_path / "first", heldout=heldout)  # fmt: skip
    assert [step for step, _ in tuned.heldout] == [0, 2, 4]
    assert tuned.heldout[0][1] == first.heldout[-1][1]
    kept = load_sequences(tmp_path / "tuned" / "checkpoint" / "heldout.jsonl")
    assert kept == heldout
    other = train_draft(target, train_set, config=config, out_dir=tmp_path / "other",
                        progress=False, init_from=tmp_path / "first")  # fmt: skip
    assert [step for step, _ in other.heldout] == [0, 2, 4]
    last_six = heldout_agreement(first.head, target, train_set[-6:], config=config)
    assert other.heldout[0][1] == last_six


def test_fine_tuning_refuses_another_kind_and_resume(target, sequences, tmp_path):
    _train(target, sequences, tmp_path / "first", num_steps=1)

    def run(**overrides):
        fields = {"num_steps": 1, "num_ttt_steps": 2, "num_heldout": 0}
        config = TrainConfig(**(fields | overrides.pop("config", {})))
        return train_draft(
            target, sequences, config=config, out_dir=tmp_path / "out", progress=False,
            init_from=tmp_path / "first", **overrides,
        )  # fmt: skip

    with pytest.raises(ValueError, match="--kind eagle3"):
        run(config={"kind": "eagle1"})
    with pytest.raises(ValueError, match="do not also give init_from"):
        run(resume=True)


def test_fine_tuning_with_a_draft_vocab_size_redraws_the_vocabulary(target, sequences, tmp_path):
    """init_from with draft_vocab_size: the head drafts over the training data's most
    frequent tokens; those it drafted before keep their trained rows (the same logits), the
    others start from the target's lm_head rows."""
    old = _train(target, sequences, tmp_path, kind="eagle3", draft_vocab_size=24, num_steps=3)
    train_set, _ = split_heldout(sequences, config=TrainConfig(num_heldout=6))
    config = TrainConfig(kind="eagle3", draft_vocab_size=40, num_heldout=6)
    new = initial_head(target, config, tmp_path, train_set)
    check_vocab_maps(new)
    assert int(new.t2d.sum()) == 40 and new.lm_head.weight.shape[0] == 40
    counts = token_frequencies(train_set, vocab_size=97)
    assert bool(new.t2d[counts.argsort(descending=True, stable=True)[:16]].all())
    old_head = old.head
    old_ids = old_head.to_target_ids(torch.arange(24))
    new_ids = new.to_target_ids(torch.arange(40))
    hidden = torch.randn(5, target.config.hidden_size, generator=torch.Generator().manual_seed(3))
    old_logits, new_logits = old_head.logits(hidden), new.logits(hidden)
    num_shared = 0
    for draft_id, token in enumerate(new_ids.tolist()):
        if bool(old_head.t2d[token]):
            old_id = old_ids.tolist().index(token)
            torch.testing.assert_close(new_logits[:, draft_id], old_logits[:, old_id])
            num_shared += 1
        else:
            torch.testing.assert_close(
                new.lm_head.weight[draft_id], target.lm_head.weight[token].float()
            )
    assert 0 < num_shared < 40
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight"):
        assert torch.equal(new.state_dict()[name], old_head.state_dict()[name].float()), name


def test_a_deeper_head_fine_tuned_from_a_trained_one_starts_where_it_ended(
    target, sequences, tmp_path
):
    """init_from a one-layer head with num_layers=2: the head gains a layer that starts as
    the identity, so its first loss is the one-layer head's on the same batch."""
    _train(target, sequences, tmp_path / "first", num_steps=1)

    def tune(out: str, **overrides):
        fields = {"num_steps": 1, "lr": 1e-9, "num_ttt_steps": 3, "num_heldout": 0}
        config = TrainConfig(**(fields | overrides))
        return train_draft(target, sequences, config=config, out_dir=tmp_path / out,
                           progress=False, init_from=tmp_path / "first")  # fmt: skip

    same, deeper = tune("same"), tune("deeper", num_layers=2)
    assert same.head.num_layers == 1 and deeper.head.num_layers == 2
    assert deeper.losses[0] == pytest.approx(same.losses[0], rel=1e-5)
    assert load_draft(tmp_path / "deeper", target=target).num_layers == 2
    with pytest.raises(ValueError, match="--kind eagle3 --num-layers 2"):
        train_draft(target, sequences, config=TrainConfig(num_steps=2),
                    out_dir=tmp_path / "deeper", progress=False, resume=True)  # fmt: skip
    shallower = TrainConfig(num_layers=1, num_steps=1)
    with pytest.raises(ValueError, match="holds a head of 2 layers, not num_layers=1"):
        train_draft(target, sequences, config=shallower, out_dir=tmp_path / "out",
                    progress=False, init_from=tmp_path / "deeper")  # fmt: skip


def test_num_layers_applies_to_dense_and_eagle3_heads():
    with pytest.raises(ValueError, match="num_layers applies to dense and eagle3 heads"):
        TrainConfig(kind="eagle1", num_layers=2)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        TrainConfig(num_layers=0)
