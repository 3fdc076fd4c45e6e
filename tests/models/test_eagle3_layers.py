"""EAGLE-3 heads of more than one layer: config.json carries the count, loading refuses
weights of another depth, and layers added to a trained head start as the identity."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specrun.models.config import DraftConfig
from specrun.models.eagle import Eagle3Head, add_layers
from specrun.models.loading import load_draft, save_draft
from specrun.runtime.distill.losses import first_features, run_target, unroll
from tiny_models import random_head, random_llama, tiny_config


@pytest.fixture(scope="module")
def target():
    return random_llama(tiny_config(), seed=0, dtype=torch.float64)


def test_num_hidden_layers_round_trips_through_config_json(target):
    layer = dataclasses.replace(target.config, num_layers=1)  # the layer's own count is 1
    config = DraftConfig(kind="eagle3", layer=layer, num_layers=3, draft_vocab_size=40)
    raw = config.to_hf()
    assert raw["num_hidden_layers"] == 3
    assert DraftConfig.from_hf(raw) == config
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        DraftConfig.from_hf(raw | {"num_hidden_layers": 0})


def test_a_head_of_n_layers_holds_the_mid_layer_and_n_minus_one_more(target):
    head = random_head("eagle3", target, num_layers=3)
    assert isinstance(head, Eagle3Head) and head.num_layers == 3
    layers = {".".join(n.split(".")[:2]) for n in head.state_dict() if n.startswith("layers.")}
    assert layers == {"layers.0", "layers.1"}
    assert all(hasattr(layer, "input_layernorm") for layer in head.layers)
    # One layer: the published names only.
    assert not any(n.startswith("layers.") for n in random_head("eagle3", target).state_dict())


def _rewrite_config(directory, **fields) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


@pytest.mark.parametrize("num_hidden_layers", [1, 3])
def test_weights_of_another_depth_are_refused(target, tmp_path, num_hidden_layers):
    directory = save_draft(random_head("eagle3", target, num_layers=2), tmp_path / "head")
    _rewrite_config(directory, num_hidden_layers=num_hidden_layers)
    with pytest.raises(ValueError) as error:
        load_draft(directory, target=target)
    assert str(error.value) == (
        f"{directory / 'model.safetensors'} holds layers.{{i}} for i in [0], but "
        f"config.json's num_hidden_layers={num_hidden_layers} gives this eagle3 head "
        f"{num_hidden_layers - 1} of them besides its mid layer; num_hidden_layers should be 2"
    )


def test_added_layers_start_as_the_identity(target):
    """A one-layer head deepened to three computes what it did, through a training-time-test
    unroll (cache + side buffer of every layer), until its new layers are trained."""
    head = random_head("eagle3", target, seed=1)
    torch.manual_seed(2)
    deeper = add_layers(head, num_layers=3)
    assert deeper.num_layers == 3 and deeper.config.num_layers == 3
    assert deeper.shared is head.shared and not deeper.training
    kept = head.state_dict()
    assert all(torch.equal(deeper.state_dict()[name], t) for name, t in kept.items())
    for layer in deeper.layers:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert layer.self_attn.qkv_proj.weight.any()  # fresh, not zero: gradients flow
    tokens = torch.randint(97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        features = first_features(head, run_target(target, tokens))
        steps = zip(unroll(head, tokens, features, num_steps=3),
                    unroll(deeper, tokens, features, num_steps=3), strict=True)  # fmt: skip
        # Equal up to float64 rounding: the deeper head shares one attention mask between
        # its layers on the CPU, the one-layer head builds its own.
        for ours, theirs in steps:
            assert theirs.k_new.shape[0] == 3
            for name in ("logits", "hidden", "k_new", "v_new"):
                got, want = getattr(theirs, name), getattr(ours, name)
                got = got[:1] if name in ("k_new", "v_new") else got
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="fewer"):
        add_layers(deeper, num_layers=2)
