"""Draft heads: published checkpoint layouts load, round-trip, fail loudly, and compute what
the EAGLE papers describe, attending over their own cache + side buffer like the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specrun.models.attention import chain_ancestors, pack_ancestor_mask
from specrun.models.config import DraftConfig
from specrun.models.eagle import DenseHead, DraftHead, Eagle1Head, Eagle3Head, build_draft
from specrun.models.llama import AttentionInputs, Llama
from specrun.models.loading import load_draft, save_draft
from tiny_models import random_llama, tiny_config

VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 97, 32, 64, 4, 2, 8
DRAFT_VOCAB = 40


@pytest.fixture(scope="module")
def target() -> Llama:
    model = random_llama(tiny_config(num_layers=4))
    assert model.tap_layers == (2, 2, 1)
    return model


# The fields yuhuili's EAGLE / EAGLE-3 releases write (transformers 4.28 era), model-independent.
PUBLISHED_FIELDS = json.loads("""{
  "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
  "max_position_embeddings": 2048, "model_type": "llama", "num_hidden_layers": 1,
  "pad_token_id": 0, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "tie_word_embeddings": false, "torch_dtype": "float16", "transformers_version": "4.28.1",
  "use_cache": true
}""")


def published_config(architecture: str, **extra) -> dict:
    """A head's config.json in the published format."""
    sizes = {"hidden_size": HIDDEN, "intermediate_size": INTER, "vocab_size": VOCAB}
    heads = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    return {"architectures": [architecture], **PUBLISHED_FIELDS, **sizes, **heads, **extra}


def _random(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        tensors[name] = 1 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise
    return tensors


def _layer_shapes(prefix: str, *, attn_in: int) -> dict[str, tuple[int, ...]]:
    """A decoder layer without input_layernorm (EAGLE-1 layer 0, the EAGLE-3 mid layer)."""
    return {
        f"{prefix}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, attn_in),
        f"{prefix}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": (INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": (INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": (HIDDEN, INTER),
        f"{prefix}.post_attention_layernorm.weight": (HIDDEN,),
    }


def eagle1_tensors(*, seed: int = 0) -> dict[str, torch.Tensor]:
    """yuhuili EAGLE-1 (cnets1.Model): fc with bias, layers.0 without input_layernorm, and the
    frozen copy of the target embedding that the training script saves along."""
    shapes = {"embed_tokens.weight": (VOCAB, HIDDEN), "fc.weight": (HIDDEN, 2 * HIDDEN)}
    shapes |= {"fc.bias": (HIDDEN,)}
    shapes |= _layer_shapes("layers.0", attn_in=HIDDEN)
    return _random(shapes, seed)


def vocab_maps(*, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft vocabulary: sorted target ids [Vd], d2t [Vd] int64, t2d [V] bool."""
    gen = torch.Generator().manual_seed(seed)
    target_ids = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids, target_ids - torch.arange(DRAFT_VOCAB), t2d


def eagle3_tensors(*, seed: int = 0) -> dict[str, torch.Tensor]:
    """yuhuili EAGLE-3 (cnets.Model) / SpecForge LlamaForCausalLMEagle3 state dict."""
    shapes = {"fc.weight": (HIDDEN, 3 * HIDDEN), "norm.weight": (HIDDEN,)}
    shapes |= {"lm_head.weight": (DRAFT_VOCAB, HIDDEN)}
    shapes |= {
        "midlayer.input_layernorm.weight": (HIDDEN,),
        "midlayer.hidden_norm.weight": (HIDDEN,),
    }
    shapes |= _layer_shapes("midlayer", attn_in=2 * HIDDEN)
    _, d2t, t2d = vocab_maps(seed=seed)
    return _random(shapes, seed) | {"d2t": d2t, "t2d": t2d}


def eagle3_layers_tensors(*, seed: int = 0) -> dict[str, torch.Tensor]:
    """A two-layer EAGLE-3 head: the mid layer, then a full decoder layer `layers.0`."""
    shapes = _layer_shapes("layers.0", attn_in=HIDDEN)
    shapes |= {"layers.0.input_layernorm.weight": (HIDDEN,)}
    return eagle3_tensors(seed=seed) | _random(shapes, seed + 1)


def write_checkpoint(directory: Path, config: dict, tensors: dict, *, fmt: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        save_file(tensors, directory / "model.safetensors")
    return directory


EAGLE3_CONFIG = published_config("LlamaForCausalLMEagle3", draft_vocab_size=DRAFT_VOCAB)
# SpecForge writes head_dim, rope_theta and (optionally) the tapped layer outputs.
SPECFORGE_FIELDS = {"head_dim": HEAD_DIM, "rope_theta": 10000.0}
SPECFORGE_FIELDS |= {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 0]}}

# layout -> (head class, config.json, tensors, key prefix)
LAYOUTS = {
    "yuhuili-eagle1": (Eagle1Head, published_config("LlamaForCausalLM"), eagle1_tensors, ""),
    "yuhuili-eagle3": (Eagle3Head, EAGLE3_CONFIG, eagle3_tensors, ""),
    "specforge-eagle3": (Eagle3Head, EAGLE3_CONFIG | SPECFORGE_FIELDS, eagle3_tensors, ""),
    # The SpecForge layout with a decoder layer after the mid layer (this project's extension).
    "specrun-eagle3-layers": (
        Eagle3Head,
        EAGLE3_CONFIG | SPECFORGE_FIELDS | {"num_hidden_layers": 2},
        eagle3_layers_tensors,
        "",
    ),
    # SpecForge's OnlineEagle3Model wrapper state dict, with an older export's embedding copy.
    "specforge-wrapped": (
        Eagle3Head,
        EAGLE3_CONFIG,
        lambda: eagle3_tensors() | {"embed_tokens.weight": torch.zeros(VOCAB, HIDDEN)},
        "draft_model.",
    ),
}


def write_layout(directory: Path, layout: str, *, fmt: str = "safetensors") -> Path:
    _, config, make_tensors, prefix = LAYOUTS[layout]
    tensors = {prefix + name: t for name, t in make_tensors().items()}
    return write_checkpoint(directory, config, tensors, fmt=fmt)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_published_layouts_load(target, tmp_path, layout, fmt):
    head_class, _, make_tensors, _ = LAYOUTS[layout]
    head = load_draft(write_layout(tmp_path / "head", layout, fmt=fmt), target=target)
    assert type(head) is head_class
    state = head.state_dict()
    for name, tensor in make_tensors().items():
        if name == "embed_tokens.weight":
            assert name not in state, "heads embed with the target's embedding"
        else:
            assert torch.equal(state[name], tensor.to(state[name].dtype)), name
    assert head.embed(torch.tensor([[3]])).equal(target.embed_tokens(torch.tensor([[3]])))
    assert head.config.layer.rope_theta == 10000.0


def random_head(target: Llama, config: DraftConfig, *, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = build_draft(config, target)
    with torch.no_grad():
        for name, param in head.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else 0.3
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, scale)
    return head.eval()


def dense_config(*, num_layers: int = 2, shared_lm_head: bool = False) -> DraftConfig:
    return DraftConfig(
        kind="dense",
        layer=tiny_config(num_layers=1),
        num_layers=num_layers,
        shared_lm_head=shared_lm_head,
    )


def head_of(kind: str, target: Llama, tmp_path: Path) -> DraftHead:
    if kind in LAYOUTS:
        return load_draft(write_layout(tmp_path / kind, kind), target=target)
    return random_head(target, dense_config(shared_lm_head=kind == "dense-shared"))


KINDS = ["yuhuili-eagle1", "specforge-eagle3", "specrun-eagle3-layers", "dense", "dense-shared"]


@pytest.mark.parametrize("kind", KINDS)
def test_save_round_trip(target, tmp_path, kind):
    head = head_of(kind, target, tmp_path)
    save_draft(head, tmp_path / "saved")
    again = load_draft(tmp_path / "saved", target=target)
    assert type(again) is type(head)
    assert again.config == head.config
    first, second = head.state_dict(), again.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    tokens, features, positions, attn = step_inputs(head, batch=2, length=3, cache_len=4)
    with torch.no_grad():
        out, out_again = (
            head(tokens, features, positions, attn),
            again(tokens, features, positions, attn),
        )
    assert torch.equal(out.logits, out_again.logits) and torch.equal(out.hidden, out_again.hidden)


def test_eagle3_saves_in_published_layout(target, tmp_path):
    head = load_draft(write_layout(tmp_path / "in", "specforge-eagle3"), target=target)
    save_draft(head, tmp_path / "out")
    assert load_file(tmp_path / "out" / "model.safetensors").keys() == eagle3_tensors().keys()
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["draft_vocab_size"] == DRAFT_VOCAB
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 1, 0]}
    assert head.config.tap_layers == target.tap_layers


def test_one_error_lists_every_bad_tensor(target, tmp_path):
    tensors = eagle3_tensors()
    del tensors["norm.weight"]
    tensors["midlayer.extra.weight"] = torch.zeros(2)
    tensors["fc.weight"] = torch.zeros(HIDDEN, 2 * HIDDEN)
    tensors["d2t"] = tensors["d2t"].to(torch.int32)
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.int8)
    config = EAGLE3_CONFIG
    directory = write_checkpoint(tmp_path / "bad", config, tensors, fmt="safetensors")
    with pytest.raises(ValueError) as error:
        load_draft(directory, target=target)
    text = str(error.value)
    assert "missing: norm.weight" in text
    assert "unexpected: midlayer.extra.weight" in text
    assert f"fc.weight: expected [{HIDDEN}, {3 * HIDDEN}], got [{HIDDEN}, {2 * HIDDEN}]" in text
    assert "wrong dtype: d2t: expected torch.int64, got torch.int32" in text
    assert "non-floating dtype: lm_head.weight: torch.int8" in text


def test_eagle1_needs_fc_bias_unless_configured_off(target, tmp_path):
    tensors = eagle1_tensors()
    del tensors["fc.bias"]
    config = LAYOUTS["yuhuili-eagle1"][1]
    with pytest.raises(ValueError, match=r"missing: fc\.bias"):
        load_draft(write_checkpoint(tmp_path / "a", config, tensors, fmt="bin"), target=target)
    no_bias = config | {"bias": False}
    head = load_draft(write_checkpoint(tmp_path / "b", no_bias, tensors, fmt="bin"), target=target)
    assert head.fc.bias is None


def test_vocab_maps(target, tmp_path):
    head = load_draft(write_layout(tmp_path / "ok", "yuhuili-eagle3"), target=target)
    target_ids, _, _ = vocab_maps()
    mapped = head.to_target_ids(torch.arange(DRAFT_VOCAB).view(4, 10))
    assert mapped.dtype == torch.int64 and mapped.shape == (4, 10)
    assert torch.equal(mapped.flatten(), target_ids)
    assert bool(head.t2d[mapped].all())
    assert int(head.t2d.sum()) == DRAFT_VOCAB
    tensors = eagle3_tensors()
    tensors["t2d"] = tensors["t2d"].roll(1)
    config = EAGLE3_CONFIG
    directory = write_checkpoint(tmp_path / "bad", config, tensors, fmt="safetensors")
    with pytest.raises(ValueError, match="t2d entry is False"):
        load_draft(directory, target=target)


def step_inputs(head: DraftHead, *, batch: int, length: int, cache_len: int, seed: int = 0):
    """Random tokens/features for `length` new tokens after `cache_len` committed ones (a
    random committed cache), chain-masked."""
    gen = torch.Generator().manual_seed(seed)
    cfg = head.config.layer
    tokens = torch.randint(0, VOCAB, (batch, length), generator=gen)
    features = torch.randn(batch, length, head.config.hidden_size, generator=gen)
    positions = torch.arange(cache_len, cache_len + length).expand(batch, -1)
    cache_shape = (head.num_layers, batch, cfg.num_kv_heads, cache_len + length + 2, cfg.head_dim)
    k_cache, v_cache = (
        torch.randn(cache_shape, generator=gen),
        torch.randn(cache_shape, generator=gen),
    )
    cache_len_t = torch.full((batch,), cache_len, dtype=torch.int64)
    attn = AttentionInputs(k_cache, v_cache, cache_len_t, chain_ancestors(batch, length, "cpu"))
    return tokens, features, positions, attn


@pytest.mark.parametrize("kind", KINDS)
def test_forward_shapes_cache_and_side_buffer(target, tmp_path, kind):
    """Shapes as documented; one chain forward over T tokens equals the same tokens run in two
    steps, the second seeing the first through the side buffer (tree mode) or the cache."""
    head = head_of(kind, target, tmp_path)
    batch, length, cache_len = 2, 5, 3
    tokens, features, positions, attn = step_inputs(
        head, batch=batch, length=length, cache_len=cache_len
    )
    with torch.no_grad():
        full = head(tokens, features, positions, attn)
        first = head(tokens[:, :2], features[:, :2], positions[:, :2], _chain(attn, 2))
        in_tree = head(
            tokens[:, 2:], features[:, 2:], positions[:, 2:], _after_side(attn, first, 3)
        )
        in_cache = head(
            tokens[:, 2:], features[:, 2:], positions[:, 2:], _after_commit(attn, first, 3)
        )
    vocab_out = DRAFT_VOCAB if isinstance(head, Eagle3Head) else VOCAB
    assert full.hidden.shape == (batch, length, HIDDEN)
    assert full.logits.shape == (batch, length, vocab_out)
    assert full.k_new.shape == (head.num_layers, batch, KV_HEADS, length, HEAD_DIM)
    assert full.v_new.shape == full.k_new.shape
    for step in (in_tree, in_cache):
        torch.testing.assert_close(torch.cat([first.hidden, step.hidden], 1), full.hidden)
        torch.testing.assert_close(torch.cat([first.logits, step.logits], 1), full.logits)
        torch.testing.assert_close(torch.cat([first.k_new, step.k_new], 3), full.k_new)


def _chain(attn: AttentionInputs, length: int) -> AttentionInputs:
    batch = attn.cache_len.shape[0]
    return AttentionInputs(
        attn.k_cache, attn.v_cache, attn.cache_len, chain_ancestors(batch, length, "cpu")
    )


def _after_side(attn: AttentionInputs, first, length: int) -> AttentionInputs:
    """The new tokens see the side buffer (the first step's K/V) and each other causally."""
    num_side = first.k_new.shape[3]
    idx = torch.arange(num_side + length)
    visible = idx[None, :] <= (num_side + torch.arange(length))[:, None]
    anc = pack_ancestor_mask(visible).expand(attn.cache_len.shape[0], -1, -1)
    return AttentionInputs(
        attn.k_cache, attn.v_cache, attn.cache_len, anc, first.k_new, first.v_new
    )


def _after_commit(attn: AttentionInputs, first, length: int) -> AttentionInputs:
    """The first step's K/V committed into the cache (index assignment), cache_len advanced."""
    k_cache, v_cache = attn.k_cache.clone(), attn.v_cache.clone()
    start = int(attn.cache_len[0])
    num_new = first.k_new.shape[3]
    k_cache[:, :, :, start : start + num_new] = first.k_new
    v_cache[:, :, :, start : start + num_new] = first.v_new
    batch = attn.cache_len.shape[0]
    anc = chain_ancestors(batch, length, "cpu")
    return AttentionInputs(k_cache, v_cache, attn.cache_len + num_new, anc)


def target_forward(target: Llama, tokens: torch.Tensor):
    """The target over a prompt [B, T] from an empty cache."""
    batch, length = tokens.shape
    cfg = target.config
    empty = torch.zeros(cfg.num_layers, batch, cfg.num_kv_heads, 1, cfg.head_dim)
    no_cache = torch.zeros(batch, dtype=torch.int64)
    anc = chain_ancestors(batch, length, "cpu")
    return target(
        tokens, torch.arange(length).expand(batch, -1), AttentionInputs(empty, empty, no_cache, anc)
    )


def test_eagle3_features_from_taps_then_from_hidden(target, tmp_path):
    """Step 1 reads projected target taps, step 2 the head's own hidden state (through the side
    buffer); together they equal one chain forward over both feature sources."""
    head = load_draft(write_layout(tmp_path / "h", "specforge-eagle3"), target=target)
    batch, length = 2, 4
    tokens = torch.randint(
        0, VOCAB, (batch, length + 1), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        target_out = target_forward(target, tokens[:, :length])
        assert target_out.taps.shape == (batch, length, 3 * HIDDEN)
        from_taps = head.target_features(target_out)
        torch.testing.assert_close(from_taps, F.linear(target_out.taps, head.fc.weight))
        # EAGLE pairs the feature at position t with token t + 1.
        _, _, positions, attn = step_inputs(head, batch=batch, length=length, cache_len=0)
        step1 = head(tokens[:, 1:], from_taps, positions, attn)
        step2_inputs = (step1.hidden[:, -1:], positions[:, -1:] + 1, _after_side(attn, step1, 1))
        step2 = head(tokens[:, -1:], *step2_inputs)
        chain = head(
            torch.cat([tokens[:, 1:], tokens[:, -1:]], 1),
            torch.cat([from_taps, step1.hidden[:, -1:]], 1),
            torch.arange(length + 1).expand(batch, -1),
            _chain(attn, length + 1),
        )
    torch.testing.assert_close(step1.hidden, chain.hidden[:, :length])
    torch.testing.assert_close(step2.logits, chain.logits[:, -1:])


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def _single_token_layer(x_attn_in, residual, t, prefix) -> torch.Tensor:
    """A decoder layer for one token with an empty cache: softmax over one key is 1, so the
    attention output is o_proj(v) with each KV head repeated for its query heads."""
    v = F.linear(x_attn_in, t[f"{prefix}.self_attn.v_proj.weight"]).view(-1, KV_HEADS, HEAD_DIM)
    attn = v.repeat_interleave(HEADS // KV_HEADS, dim=1).flatten(1)
    h = residual + F.linear(attn, t[f"{prefix}.self_attn.o_proj.weight"])
    mlp_in = _rms(h, t[f"{prefix}.post_attention_layernorm.weight"])
    gate = F.silu(F.linear(mlp_in, t[f"{prefix}.mlp.gate_proj.weight"]))
    up = F.linear(mlp_in, t[f"{prefix}.mlp.up_proj.weight"])
    return h + F.linear(gate * up, t[f"{prefix}.mlp.down_proj.weight"])


@pytest.mark.parametrize("layout", ["yuhuili-eagle1", "yuhuili-eagle3", "specrun-eagle3-layers"])
def test_published_semantics_by_hand(target, tmp_path, layout):
    """The layer wiring the papers' code uses, recomputed from the raw checkpoint tensors."""
    head = load_draft(write_layout(tmp_path / "h", layout), target=target)
    t = LAYOUTS[layout][2]()
    tokens, features, positions, attn = step_inputs(head, batch=3, length=1, cache_len=0)
    with torch.no_grad():
        out = head(tokens, features, positions, attn)
        embed = target.embed_tokens(tokens[:, 0])
        feature = features[:, 0]
        if layout == "yuhuili-eagle1":
            x = F.linear(torch.cat([embed, feature], -1), t["fc.weight"], t["fc.bias"])
            hidden = _single_token_layer(x, x, t, "layers.0")
            logits = target.lm_head(hidden)
        else:
            mixed = torch.cat(
                [
                    _rms(embed, t["midlayer.input_layernorm.weight"]),
                    _rms(feature, t["midlayer.hidden_norm.weight"]),
                ],
                -1,
            )
            hidden = _single_token_layer(mixed, feature, t, "midlayer")
            if "layers.0.input_layernorm.weight" in t:  # a full layer after the mid layer
                normed = _rms(hidden, t["layers.0.input_layernorm.weight"])
                hidden = _single_token_layer(normed, hidden, t, "layers.0")
            logits = F.linear(_rms(hidden, t["norm.weight"]), t["lm_head.weight"])
    torch.testing.assert_close(out.hidden[:, 0], hidden)
    torch.testing.assert_close(out.logits[:, 0], logits)


def test_incompatible_heads_are_refused(target, tmp_path):
    base = EAGLE3_CONFIG | SPECFORGE_FIELDS
    tensors = eagle3_tensors()
    wrong_taps = base | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    with pytest.raises(ValueError, match=r"tap_layers=\(1, 2, 3\)"):
        load_draft(
            write_checkpoint(tmp_path / "taps", wrong_taps, tensors, fmt="bin"), target=target
        )
    wrong_vocab = base | {"vocab_size": VOCAB + 1}
    with pytest.raises(ValueError, match="vocab_size"):
        load_draft(
            write_checkpoint(tmp_path / "vocab", wrong_vocab, tensors, fmt="bin"), target=target
        )
    wide = LAYOUTS["yuhuili-eagle1"][1] | {"hidden_size": 2 * HIDDEN, "head_dim": HEAD_DIM}
    with pytest.raises(ValueError, match="hidden_size"):
        load_draft(
            write_checkpoint(tmp_path / "wide", wide, eagle1_tensors(), fmt="bin"), target=target
        )


def test_narrow_eagle3_head_owns_its_embedding(target, tmp_path):
    narrow = 16
    config = DraftConfig(
        kind="eagle3",
        layer=tiny_config(hidden_size=narrow, num_layers=1),
        target_hidden_size=HIDDEN,
        draft_vocab_size=DRAFT_VOCAB,
    )
    head = random_head(target, config)
    assert head.embed_tokens.weight.shape == (VOCAB, narrow)
    assert head.fc.weight.shape == (narrow, 3 * HIDDEN)
    save_draft(head, tmp_path / "h")
    again = load_draft(tmp_path / "h", target=target)
    assert torch.equal(again.embed_tokens.weight, head.embed_tokens.weight)
    tensors = load_file(tmp_path / "h" / "model.safetensors")
    del tensors["embed_tokens.weight"]
    save_file(tensors, tmp_path / "h" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing: embed_tokens\.weight"):
        load_draft(tmp_path / "h", target=target)


def test_dense_head_borrows_only_what_it_says(target):
    own = random_head(target, dense_config())
    shared = random_head(target, dense_config(shared_lm_head=True))
    assert isinstance(own, DenseHead) and own.lm_head.weight.shape == (VOCAB, HIDDEN)
    assert "lm_head.weight" not in shared.state_dict()
    assert not any(p is target.embed_tokens.weight for p in own.parameters())
    assert len(own.layers) == 2 and all(hasattr(layer, "input_layernorm") for layer in own.layers)
    hidden = torch.randn(2, 3, HIDDEN)
    torch.testing.assert_close(shared.logits(hidden), target.lm_head(shared.norm(hidden)))
    assert own.to_target_ids(torch.arange(5)).equal(torch.arange(5))
