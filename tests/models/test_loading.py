"""Loading HF Llama checkpoints: logits equal transformers', every file format, every error."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from specrun.models import checkpoint, loading
from specrun.models.attention import chain_ancestors
from specrun.models.llama import AttentionInputs, Llama
from specrun.models.loading import load_target, save_target

logger = logging.getLogger(__name__)

ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
}


def hf_config(
    *,
    num_kv_heads: int = 2,
    gqa: int = 2,
    head_dim: int = 8,
    tied: bool = False,
    rope: str = "default",
    bias: bool = False,
) -> HFLlamaConfig:
    return HFLlamaConfig(
        vocab_size=61,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=num_kv_heads * gqa,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 500.0, **ROPES[rope]},
    )


def hf_model(config: HFLlamaConfig, *, seed: int = 0) -> LlamaForCausalLM:
    """Random weights big enough that every parameter moves the logits (which stay O(1-10),
    so float32 rounding stays well below the 1e-5 tolerance)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 0.3)
            else:
                param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
    return model


def our_logits(model: Llama, tokens: torch.Tensor, *, prefix_len: int) -> torch.Tensor:
    """Logits [B, T, V]: tokens[:, :prefix_len] prefilled into the cache, then the rest at
    positions prefix_len.. with cache_len = prefix_len (K/V committed by index assignment)."""
    batch, length = tokens.shape
    cfg = model.config
    k_cache = torch.zeros(cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    chunks = []
    for start, end in ((0, prefix_len), (prefix_len, length)):
        if start == end:
            continue
        positions = torch.arange(start, end).expand(batch, -1)
        anc = chain_ancestors(batch, end - start, "cpu")
        cache_len = torch.full((batch,), start, dtype=torch.int64)
        out = model(
            tokens[:, start:end], positions, AttentionInputs(k_cache, v_cache, cache_len, anc)
        )
        k_cache[:, :, :, start:end] = out.k_new
        v_cache[:, :, :, start:end] = out.v_new
        chunks.append(model.logits(out.hidden))
    return torch.cat(chunks, dim=1)


def assert_matches_hf(model: Llama, hf: LlamaForCausalLM, *, prefix_len: int) -> float:
    tokens = torch.randint(
        0, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf(tokens).logits
        got = our_logits(model, tokens, prefix_len=prefix_len)
    diff = (got - expected).abs().max().item()
    assert diff < 1e-5, diff
    return diff


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_kv_heads=st.sampled_from([1, 2]),
    gqa=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8, 16]),
    tied=st.booleans(),
    rope=st.sampled_from(sorted(ROPES)),
    bias=st.booleans(),
    prefix_len=st.integers(0, 10),
)
def test_logits_match_transformers(num_kv_heads, gqa, head_dim, tied, rope, bias, prefix_len):
    config = hf_config(
        num_kv_heads=num_kv_heads, gqa=gqa, head_dim=head_dim, tied=tied, rope=rope, bias=bias
    )
    hf = hf_model(config)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = load_target(tmp)
    assert model.config.tie_word_embeddings == tied
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    diff = assert_matches_hf(model, hf, prefix_len=prefix_len)
    logger.info(
        "max |logit diff| vs transformers (rope=%s tied=%s gqa=%d): %.2e", rope, tied, gqa, diff
    )


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory) -> tuple[LlamaForCausalLM, Path]:
    hf = hf_model(hf_config(rope="llama3", bias=True))
    directory = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(directory)
    return hf, directory


def same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sharded_safetensors(hf_pair, tmp_path):
    hf, single = hf_pair
    hf.save_pretrained(tmp_path, max_shard_size="4KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert same_tensors(load_target(tmp_path), load_target(single))


def write_bin_checkpoint(hf: LlamaForCausalLM, directory: Path, *, num_shards: int) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(hf.config.to_json_string())
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    if num_shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(num_shards):
        file = f"pytorch_model-{i + 1:05d}-of-{num_shards:05d}.bin"
        shard = {n: state[n] for n in names[i::num_shards]}
        torch.save(shard, directory / file)
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("num_shards", [1, 3])
def test_legacy_bin_loads_with_weights_only(hf_pair, tmp_path, monkeypatch, num_shards):
    hf, single = hf_pair
    write_bin_checkpoint(hf, tmp_path / "bin", num_shards=num_shards)
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "load", spy)
    model = load_target(tmp_path / "bin")
    assert len(calls) == num_shards
    assert all(c["weights_only"] and c["mmap"] and c["map_location"] == "cpu" for c in calls)
    assert same_tensors(model, load_target(single))
    assert_matches_hf(model, hf, prefix_len=4)


class NotATensor:
    pass


@pytest.mark.parametrize(
    ("extra", "message"),
    [(NotATensor(), "weights_only"), (3, "not tensors"), (None, "not tensors")],
)
def test_bin_with_non_tensor_objects_is_refused(hf_pair, tmp_path, extra, message):
    hf, single = hf_pair
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    torch.save({**hf.state_dict(), "step": extra}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=message):
        load_target(tmp_path)


def test_one_error_lists_every_bad_tensor(hf_pair, tmp_path, monkeypatch):
    _, single = hf_pair
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    state = load_file(single / "model.safetensors")
    del state["model.norm.weight"], state["lm_head.weight"]
    state["model.layers.0.extra.weight"] = torch.zeros(3)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 5)
    state["model.layers.0.input_layernorm.weight"] = torch.zeros(24, dtype=torch.int32)
    save_file(state, tmp_path / "model.safetensors")
    assigned = []
    monkeypatch.setattr(loading, "assign", lambda *args: assigned.append(args))
    with pytest.raises(ValueError) as error:
        load_target(tmp_path)
    text = str(error.value)
    assert "missing: lm_head.weight, norm.weight" in text
    assert "unexpected: layers.0.extra.weight" in text
    assert "layers.1.mlp.up_proj.weight: expected [40, 24], got [7, 5]" in text
    assert "non-floating dtype: layers.0.input_layernorm.weight: torch.int32" in text
    assert not assigned, "nothing may be read or allocated before the check"


def test_parameters_are_meta_until_assigned(hf_pair, monkeypatch):
    _, single = hf_pair
    seen = []
    real_assign = loading.assign

    def checked_assign(model, name, tensor):
        real = {n for n, p in model.named_parameters() if not p.is_meta}
        assert real <= set(seen), f"{real - set(seen)} materialised before assignment"
        seen.append(name)
        real_assign(model, name, tensor)

    monkeypatch.setattr(loading, "assign", checked_assign)
    model = load_target(single)
    # Each parameter once (a fused projection when its first part arrives).
    assert sorted(seen) == sorted(name for name, _ in model.named_parameters())
    assert not any(p.is_meta for p in model.parameters())


def test_dtype_device_and_round_trip(hf_pair, tmp_path):
    hf, single = hf_pair
    model = load_target(single, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.column_freq.dtype == torch.float32
    original = load_target(single)
    save_target(original, tmp_path)
    assert same_tensors(load_target(tmp_path), original)
    assert_matches_hf(load_target(tmp_path), hf, prefix_len=0)


def test_tied_round_trip_omits_lm_head(tmp_path):
    hf = hf_model(hf_config(tied=True))
    hf.save_pretrained(tmp_path / "hf")
    model = load_target(tmp_path / "hf")
    save_target(model, tmp_path / "ours")
    assert "lm_head.weight" not in load_file(tmp_path / "ours" / "model.safetensors")
    assert same_tensors(load_target(tmp_path / "ours"), model)


def test_tap_layers_reach_the_model(hf_pair):
    _, single = hf_pair
    assert load_target(single, tap_layers=(1, 2)).tap_layers == (1, 2)


def test_untied_checkpoint_needs_lm_head(hf_pair, tmp_path):
    _, single = hf_pair
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    state = load_file(single / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing: lm_head\.weight"):
        load_target(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("architectures", ["MistralForCausalLM"], "architectures"),
        ("model_type", "mistral", "model_type"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 2.0}, "rope_type"),
        ("hidden_act", "gelu", "hidden_act"),
    ],
)
def test_unsupported_config_names_the_field(hf_pair, tmp_path, field, value, message):
    _, single = hf_pair
    raw = json.loads((single / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {field: value}))
    (tmp_path / "model.safetensors").symlink_to(single / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_target(tmp_path)


def test_missing_directory_or_weights(hf_pair, tmp_path):
    _, single = hf_pair
    with pytest.raises(ValueError, match="does not exist"):
        load_target(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model\.safetensors.*pytorch_model\.bin"):
        load_target(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "model.safetensors").symlink_to(single / "model.safetensors")
    with pytest.raises(ValueError, match=r"config\.json"):
        load_target(tmp_path)


def test_index_naming_a_missing_shard(hf_pair, tmp_path):
    hf, _ = hf_pair
    hf.save_pretrained(tmp_path, max_shard_size="4KB")
    next(tmp_path.glob("model-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="do not exist"):
        load_target(tmp_path)
