"""Malformed model files: every one is a ValueError naming the file, what is wrong with it and
what to do, and the CLI reports it in one line instead of a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specrun.models.checkpoint import write_safetensors
from specrun.models.config import DraftConfig, LlamaConfig
from specrun.models.llama import Llama
from specrun.models.loading import load_draft, load_target, save_draft, save_target
from specrun.tools.cli import main
from tiny_models import random_head, random_llama, tiny_config

GOOD_COPY = "re-download the model, or re-convert it"


@pytest.fixture(scope="module")
def target() -> Llama:
    model = random_llama(tiny_config())
    assert model.config.num_layers == 2 and model.tap_layers == (2, 1, 0)
    return model


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory) -> Path:
    return save_target(target, tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def sharded_dir(target_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    shutil.copy(target_dir / "config.json", out)
    write_safetensors(load_file(target_dir / "model.safetensors"), out, max_shard_bytes=8192)
    return out


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory) -> Path:
    return save_draft(random_head("eagle3", target), tmp_path_factory.mktemp("head"))


def copy_of(directory: Path, tmp_path: Path) -> Path:
    out = tmp_path / f"broken-{directory.name}"
    shutil.copytree(directory, out)
    return out


def cut(path: Path, keep: str | int) -> Path:
    """Truncate `path` to `keep` bytes ("half": half of them), as an interrupted download does."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep == "half" else keep])
    return path


def with_config(directory: Path, **fields) -> Path:
    """`directory`'s config.json with `fields` replaced (a value of ... removes the field)."""
    path = directory / "config.json"
    raw = json.loads(path.read_text()) | fields
    path.write_text(json.dumps({k: v for k, v in raw.items() if v is not ...}))
    return path


def error_of(load, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        load(*args, **kwargs)
    message = str(error.value)
    assert "\n" not in message, "the CLI prints errors on one line"
    return message


@pytest.mark.parametrize("keep", ["half", 4, 0])
def test_truncated_safetensors_is_named_with_what_to_do(target_dir, tmp_path, keep):
    weights = cut(copy_of(target_dir, tmp_path) / "model.safetensors", keep)
    message = error_of(load_target, weights.parent)
    assert message.startswith(f"{weights} is truncated or corrupt ")
    assert GOOD_COPY in message


def test_truncated_shard_is_named(sharded_dir, tmp_path):
    assert load_target(sharded_dir).config.num_layers == 2
    shards = sorted(copy_of(sharded_dir, tmp_path).glob("model-*.safetensors"))
    assert len(shards) > 2
    cut(shards[1], "half")
    message = error_of(load_target, shards[1].parent)
    assert message.startswith(f"{shards[1]} is truncated or corrupt ")
    assert GOOD_COPY in message


def test_truncated_head_is_named(head_dir, target, tmp_path):
    weights = cut(copy_of(head_dir, tmp_path) / "model.safetensors", "half")
    assert f"{weights} is truncated or corrupt " in error_of(
        load_draft, weights.parent, target=target
    )


def test_git_lfs_pointer_is_recognised(target_dir, tmp_path):
    weights = copy_of(target_dir, tmp_path) / "model.safetensors"
    weights.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")
    message = error_of(load_target, weights.parent)
    assert message.startswith(f"{weights} is a Git LFS pointer, not the weights")
    assert "git lfs pull" in message


def test_truncated_bin_is_named(target, tmp_path):
    directory = tmp_path / "bin"
    save_target(target, directory)
    state = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")
    weights = cut(directory / "pytorch_model.bin", "half")
    message = error_of(load_target, directory)
    assert message.startswith(f"{weights} is truncated or corrupt ")
    assert GOOD_COPY in message


INDEX = "model.safetensors.index.json"


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        ('{"weight_map": {', "is not valid JSON"),
        ("[]", 'has no "weight_map" object'),
        ('{"metadata": {}}', 'has no "weight_map" object'),
        ('{"weight_map": {"lm_head.weight": 3}}', "must map tensor names to shard file names"),
        ('{"weight_map": {"lm_head.weight": "../x.safetensors"}}', "shard file names beside it"),
        ('{"weight_map": {"lm_head.weight": "gone.safetensors"}}', "do not exist: ['gone"),
    ],
)
def test_malformed_index_is_named(sharded_dir, tmp_path, index, expected):
    path = copy_of(sharded_dir, tmp_path) / INDEX
    path.write_text(index)
    message = error_of(load_target, path.parent)
    assert message.startswith(str(path))
    assert expected in message
    assert GOOD_COPY in message


def test_config_that_is_not_an_object(target_dir, tmp_path):
    path = copy_of(target_dir, tmp_path) / "config.json"
    path.write_text("[1, 2]")
    message = error_of(load_target, path.parent)
    assert message == f"{path}: the config must be a JSON object of fields, got [1, 2] (an array)"
    assert str(path) in error_of(DraftConfig.from_json, path)


def test_config_that_is_not_json(target_dir, tmp_path):
    path = copy_of(target_dir, tmp_path) / "config.json"
    path.write_text('{"vocab_size": 97,\n "hidden_size": }')
    message = error_of(load_target, path.parent)
    assert message.startswith(f"{path} is not valid JSON (Expecting value at line 2 column ")
    assert str(path) in error_of(DraftConfig.from_json, path.parent)
    path.write_bytes(b'{"vocab_size": "\xff"}')
    assert error_of(load_target, path.parent).startswith(f"{path} is not UTF-8 text")


BAD_TARGET_FIELDS = [
    ("vocab_size", "abc", 'field "vocab_size" must be an integer, got "abc" (a string)'),
    ("vocab_size", None, 'field "vocab_size" must be an integer, got null'),
    ("vocab_size", 0, 'field "vocab_size" must be a positive integer, got 0'),
    ("num_hidden_layers", "2", 'field "num_hidden_layers" must be an integer, got "2" (a string)'),
    ("num_hidden_layers", 2.0, 'field "num_hidden_layers" must be an integer, got 2.0 (a number)'),
    ("num_hidden_layers", 0, 'field "num_hidden_layers" must be a positive integer, got 0'),
    ("hidden_size", True, 'field "hidden_size" must be an integer, got true (a boolean)'),
    (
        "intermediate_size",
        [64],
        'field "intermediate_size" must be an integer, got [64] (an array)',
    ),
    ("head_dim", "8", 'field "head_dim" must be an integer or null, got "8" (a string)'),
    ("num_key_value_heads", 2.5, 'field "num_key_value_heads" must be an integer or null'),
    (
        "tie_word_embeddings",
        "false",
        'field "tie_word_embeddings" must be a boolean (true or false), got "false" (a string)',
    ),
    ("attention_bias", 0, 'field "attention_bias" must be a boolean (true or false), got 0'),
    ("rms_norm_eps", "1e-5", 'field "rms_norm_eps" must be a finite number, got "1e-5"'),
    ("rope_theta", float("nan"), 'field "rope_theta" must be a finite number, got NaN'),
    ("max_position_embeddings", None, 'field "max_position_embeddings" must be an integer'),
    ("bos_token_id", "1", 'field "bos_token_id" must be an integer or null, got "1"'),
    ("eos_token_id", [2, "3"], 'field "eos_token_id" must be an integer, an array of integers'),
    ("architectures", "LlamaForCausalLM", 'field "architectures" must be an array or null'),
    ("model_type", None, 'field "model_type" must be a string, got null'),
    ("rope_scaling", "linear", 'field "rope_scaling" must be an object or null, got "linear"'),
    (
        "rope_scaling",
        {"rope_type": "linear", "factor": "2"},
        'field "rope_scaling.factor" must be a finite number, got "2" (a string)',
    ),
    (
        "rope_parameters",
        {"rope_type": "default", "rope_theta": "1e4"},
        'field "rope_parameters.rope_theta" must be a finite number',
    ),
]


@pytest.mark.parametrize(("field", "value", "expected"), BAD_TARGET_FIELDS)
def test_mistyped_target_field_names_file_and_field(target_dir, tmp_path, field, value, expected):
    path = with_config(copy_of(target_dir, tmp_path), **{field: value})
    assert error_of(load_target, path.parent).startswith(f"{path}: {expected}")


def test_missing_fields_are_named_with_the_file(target_dir, tmp_path):
    path = with_config(copy_of(target_dir, tmp_path), vocab_size=..., hidden_size=...)
    message = error_of(LlamaConfig.from_json, path)
    assert message == f"{path}: missing required field(s) ['vocab_size', 'hidden_size']"


def test_nulls_and_integers_load_where_hf_writes_them(target, target_dir, tmp_path):
    fields = {"head_dim": None, "rope_scaling": None, "bos_token_id": None, "rope_theta": 10000}
    path = with_config(copy_of(target_dir, tmp_path), eos_token_id=[2, 3], **fields)
    config = LlamaConfig.from_json(path)
    assert config.head_dim == target.config.head_dim
    assert config.rope_theta == 10000.0 and isinstance(config.rope_theta, float)
    assert config.eos_token_ids == (2, 3) and config.bos_token_id is None
    with_config(path.parent, num_key_value_heads=None, eos_token_id=None)
    config = LlamaConfig.from_json(path)
    assert config.num_kv_heads == config.num_heads and config.eos_token_ids == ()


def test_parsers_check_types_without_a_file(target):
    raw = target.config.to_hf()
    with pytest.raises(ValueError, match=r"JSON object of fields, got \[\] \(an array\)"):
        LlamaConfig.from_hf([])
    with pytest.raises(ValueError, match='"tie_word_embeddings" must be a boolean'):
        LlamaConfig.from_hf(raw | {"tie_word_embeddings": "true"})
    with pytest.raises(ValueError, match='"bias" must be a boolean'):
        DraftConfig.from_hf(raw | {"bias": "false"}, kind="eagle1")
    with pytest.raises(ValueError, match="tap_layers must be layer indices >= 0"):
        DraftConfig(kind="eagle3", layer=target.config, tap_layers=(-1, 0, 1))


BAD_HEAD_FIELDS = [
    ("draft_vocab_size", "48", 'field "draft_vocab_size" must be an integer or null, got "48"'),
    ("target_hidden_size", "32", 'field "target_hidden_size" must be an integer or null'),
    ("target_hidden_size", 0, "target_hidden_size must be a positive integer, got 0"),
    ("bias", "false", 'field "bias" must be a boolean (true or false), got "false" (a string)'),
    ("specrun_shared_lm_head", 1, 'field "specrun_shared_lm_head" must be a boolean'),
    ("specrun_draft_kind", 3, 'field "specrun_draft_kind" must be a string, got 3 (an integer)'),
    ("num_hidden_layers", "1", 'field "num_hidden_layers" must be an integer, got "1"'),
    ("vocab_size", None, 'field "vocab_size" must be an integer, got null'),
    ("eagle_config", [1, 0, -1], 'field "eagle_config" must be an object or null'),
    (
        "eagle_config",
        {"eagle_aux_hidden_state_layer_ids": ["1", 0, -1]},
        'field "eagle_config.eagle_aux_hidden_state_layer_ids" must be an array of integers',
    ),
    (
        "eagle_config",
        {"eagle_aux_hidden_state_layer_ids": [1, -3, 0]},
        "tap_layers must be layer indices >= 0",
    ),
]


@pytest.mark.parametrize(("field", "value", "expected"), BAD_HEAD_FIELDS)
def test_mistyped_head_field_names_file_and_field(
    head_dir, target, tmp_path, field, value, expected
):
    path = with_config(copy_of(head_dir, tmp_path), **{field: value})
    message = error_of(load_draft, path.parent, target=target)
    assert message.startswith(f"{path}: ")
    assert expected in message


def test_head_for_a_wider_target_says_so(target, tmp_path):
    wide = random_llama(tiny_config(hidden_size=48, head_dim=12, num_layers=4))
    directory = save_draft(random_head("eagle3", wide), tmp_path / "wide-head")
    message = error_of(load_draft, directory, target=target)
    assert message == (
        f"{directory}: draft head does not fit the target: it was trained on a target with "
        "hidden_size 48, this target's hidden_size is 32; use a head trained for this target"
    )


def test_head_tapping_past_the_target_says_so(head_dir, target, tmp_path):
    taps = {"eagle_aux_hidden_state_layer_ids": [1, 0, 39]}
    path = with_config(copy_of(head_dir, tmp_path), eagle_config=taps)
    message = error_of(load_draft, path.parent, target=target)
    assert message == (
        f"{path.parent}: draft head does not fit the target: it taps layer(s) [40] "
        "(eagle_aux_hidden_state_layer_ids [39]) but the target has 2 layers (taps 0..2, tap i "
        "being the input of layer i); it was trained for a deeper model: use a head trained for "
        "this target"
    )


def test_head_with_a_wrong_number_of_taps_says_so(head_dir, target, tmp_path):
    path = with_config(
        copy_of(head_dir, tmp_path), eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 0]}
    )
    message = error_of(load_draft, path.parent, target=target)
    assert "EAGLE-3 heads read 3 target taps, it lists 2 (tap_layers=(2, 1)" in message
    assert "load the target with" not in message


def test_head_on_other_taps_of_this_target_suggests_them(head_dir, target_dir, tmp_path):
    taps = {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}
    path = with_config(copy_of(head_dir, tmp_path), eagle_config=taps)
    target = load_target(target_dir)
    message = error_of(load_draft, path.parent, target=target)
    assert message.endswith("; load the target with tap_layers=(1, 1, 2)")
    head = load_draft(path.parent, target=load_target(target_dir, tap_layers=(1, 1, 2)))
    assert head.config.tap_layers == (1, 1, 2)


def break_config(directory: Path) -> Path:
    return with_config(directory, tie_word_embeddings="false")


def break_weights(directory: Path) -> Path:
    return cut(directory / "model.safetensors", 4)


def break_json(directory: Path) -> Path:
    path = directory / "config.json"
    path.write_text("[]")
    return path


@pytest.mark.parametrize("damage", [break_config, break_weights, break_json])
def test_cli_reports_a_malformed_file_in_one_line(target_dir, tmp_path, capsys, damage):
    broken = damage(copy_of(target_dir, tmp_path))
    status = main(["init-draft", "--model", str(broken.parent), "--out", str(tmp_path / "out")])
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"specrun init-draft: error: {broken}")
    assert not (tmp_path / "out").exists()
