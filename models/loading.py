"""Loading and saving targets and draft heads: HF and published EAGLE layouts.

Loading never holds a checkpoint twice: the model is built on the meta device, the checkpoint's
headers are checked against it (one ValueError listing every missing, unexpected, mis-shaped or
wrongly typed tensor, before any allocation), then tensors are read, converted to the requested
dtype/device and assigned one at a time. Non-persistent buffers are recomputed and tied
weights re-tied last. File formats live in checkpoint.py.

Key names (fused projections are stored as their parts, see fused_linear.py):
  target  HF LlamaForCausalLM: `model.` prefix stripped, `lm_head.weight` top level; a tied
          checkpoint may omit lm_head.weight (if present it is checked and ignored); stale
          `rotary_emb.inv_freq` buffers of old checkpoints are ignored.
  drafts  the published names are the heads' state-dict names (see eagle.py):
          EAGLE-1 (yuhuili cnets1): fc.{weight,bias}, layers.{i}.*;
          EAGLE-3 (yuhuili cnets / SpecForge LlamaForCausalLMEagle3): fc.weight, midlayer.*,
          norm.weight, lm_head.weight, d2t, t2d, and in heads of more than one layer this
          project's layers.{i}.* after the mid layer; SpecForge's training wrapper prefixes
          `draft_model.` (stripped). A checkpoint's layers.{i} must be those its config.json's
          num_hidden_layers gives (checked first, with an error of its own). A checkpoint's
          embed_tokens.weight (EAGLE-1 and older SpecForge exports carry a frozen copy of the
          target's) is checked and dropped: heads embed with the target's, except an EAGLE-3
          head narrower than its target, which owns an embedding and requires it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from .checkpoint import (
    Checkpoint,
    TensorInfo,
    TensorSpec,
    check_tensors,
    existing_dir,
    write_safetensors,
)
from .config import DraftConfig, LlamaConfig
from .eagle import DraftHead, Eagle3Head, build_draft
from .fused_linear import part_slices
from .llama import Llama
from .tensor_parallel import Sharding, build_sharded_llama, shard_slices

logger = logging.getLogger(__name__)

TARGET_PREFIX = "model."
DRAFT_PREFIXES = ("draft_model.",)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LAYER_NAME = re.compile(r"layers\.(\d+)\.")


def load_target(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tap_layers: tuple[int, ...] | None = None,
    sharding: Sharding | None = None,
) -> Llama:
    """A Llama from an HF model directory (config.json + safetensors or legacy .bin).

    Floating tensors are converted to `dtype`; everything lands on `device`. `tap_layers`
    as in Llama (None: the EAGLE-3 defaults). With `sharding`, this rank's tensor-parallel
    shard (models/tensor_parallel.py), reading only its block of each tensor.
    """
    directory = existing_dir(model_dir)
    config = LlamaConfig.from_json(directory)
    checkpoint = Checkpoint(directory)
    with torch.device("meta"):
        model = Llama(config, tap_layers=tap_layers)
        expected = specs_of(model)
        if sharding is not None:
            model = build_sharded_llama(config, sharding, tap_layers=tap_layers)
    names = _rename(checkpoint.infos, prefixes=(TARGET_PREFIX,))
    optional = {}
    if config.tie_word_embeddings:
        optional["lm_head.weight"] = expected.pop("lm_head.weight")
    found = {ours: checkpoint.infos[theirs] for ours, theirs in names.items()}
    check_tensors(found, expected, optional=optional, source=str(checkpoint.path))
    blocks = None
    if sharding is not None:
        blocks = {n: shard_slices(n, spec.shape, sharding) for n, spec in expected.items()}
    _materialise(
        model,
        checkpoint,
        {n: names[n] for n in expected},
        dtype=dtype,
        device=device,
        blocks=blocks,
    )
    model.rotary.init_buffers(device)
    model.tie_weights()
    _check_materialised(model)
    return model.eval()


def load_draft(
    head_dir: str | Path,
    *,
    target: Llama,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> DraftHead:
    """A draft head from its directory (config.json + weights), wired to `target`.

    dtype / device default to the target's. The head kind comes from config.json
    (see DraftConfig.from_hf).
    """
    directory = existing_dir(head_dir)
    config = DraftConfig.from_json(directory)
    checkpoint = Checkpoint(directory)
    dtype = dtype or target.embed_tokens.weight.dtype
    device = device or target.embed_tokens.weight.device
    with torch.device("meta"):
        try:
            head = build_draft(config, target)
        except ValueError as error:
            raise ValueError(f"{directory}: {error}") from error
    names = _rename(checkpoint.infos, prefixes=DRAFT_PREFIXES)
    check_layer_count(names, head, source=str(checkpoint.path))
    expected = specs_of(head)
    optional = {}
    if "embed_tokens.weight" not in expected:
        embed = target.embed_tokens.weight
        optional["embed_tokens.weight"] = TensorSpec(tuple(embed.shape))
    found = {ours: checkpoint.infos[theirs] for ours, theirs in names.items()}
    check_tensors(found, expected, optional=optional, source=str(checkpoint.path))
    _materialise(head, checkpoint, {n: names[n] for n in expected}, dtype=dtype, device=device)
    head.init_buffers(device)
    _check_materialised(head)
    if isinstance(head, Eagle3Head):
        check_vocab_maps(head)
    logger.info("loaded %s draft head from %s", config.kind, checkpoint.path)
    return head.eval()


def save_target(model: Llama, out_dir: str | Path) -> Path:
    """Write `model` as an HF directory (config.json + model.safetensors). Returns the dir."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        key = name if name == "lm_head.weight" else TARGET_PREFIX + name
        tensors[key] = tensor
    return _write(tensors, model.config.to_hf(), out_dir)


def save_draft(
    head: DraftHead,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write `head` in its published layout (see the module docstring) with a config.json
    that DraftConfig.from_json reads back. Borrowed target modules are not written.

    `dtype` casts the floating weights (the vocabulary maps keep theirs); `max_shard_bytes`
    splits the weights into indexed shards of at most that size.
    """
    tensors = {
        name: t.to(dtype) if dtype is not None and t.is_floating_point() else t
        for name, t in head.state_dict().items()
    }
    return _write(tensors, head.config.to_hf(), out_dir, max_shard_bytes=max_shard_bytes)


def specs_of(model: nn.Module) -> dict[str, TensorSpec]:
    """What a checkpoint must hold for `model`: floating weights any dtype, others exact."""
    return {
        name: TensorSpec(tuple(t.shape), None if t.is_floating_point() else t.dtype)
        for name, t in model.state_dict().items()
    }


def check_layer_count(names: Iterable[str], head: DraftHead, *, source: str) -> None:
    """Raise ValueError unless the decoder layers `layers.{i}.*` among the tensor `names`
    are exactly those of `head` (built from config.json's num_hidden_layers)."""
    found = sorted({int(m.group(1)) for name in names if (m := LAYER_NAME.match(name))})
    expected = len(getattr(head, "layers", ()))
    if found == list(range(expected)):
        return
    config = head.config
    extra = 1 if config.kind == "eagle3" else 0  # the mid layer, not among layers.{i}
    fix = "fix num_hidden_layers or the weights"
    if found == list(range(len(found))):
        fix = f"num_hidden_layers should be {len(found) + extra}"
    mid = " besides its mid layer" if extra else ""
    raise ValueError(
        f"{source} holds layers.{{i}} for i in {found}, but config.json's num_hidden_layers="
        f"{config.num_layers} gives this {config.kind} head {expected} of them{mid}; {fix}"
    )


def check_vocab_maps(head: Eagle3Head) -> None:
    """Raise ValueError unless every draft id maps (via d2t) into the vocabulary onto a
    token that t2d marks as drafted. Load-time only: reads tensor values."""
    draft_ids = torch.arange(head.d2t.shape[0], device=head.d2t.device)
    target_ids = head.to_target_ids(draft_ids)
    vocab = head.t2d.shape[0]
    in_range = (target_ids >= 0) & (target_ids < vocab)
    if not bool(in_range.all()):
        bad = draft_ids[~in_range][:8].tolist()
        raise ValueError(f"d2t maps draft ids {bad} outside the vocabulary [0, {vocab})")
    unmarked = ~head.t2d[target_ids]
    if bool(unmarked.any()):
        bad = draft_ids[unmarked][:8].tolist()
        raise ValueError(f"d2t maps draft ids {bad} onto target ids whose t2d entry is False")


def _rename(infos: Mapping[str, TensorInfo], *, prefixes: tuple[str, ...]) -> dict[str, str]:
    """Our name -> checkpoint name: known prefixes stripped, stale buffers dropped."""
    names: dict[str, str] = {}
    for theirs in infos:
        if theirs.endswith(IGNORED_SUFFIXES):
            continue
        ours = next((theirs[len(p) :] for p in prefixes if theirs.startswith(p)), theirs)
        if ours in names:
            raise ValueError(f"checkpoint holds both {names[ours]} and {theirs}")
        names[ours] = theirs
    return names


def _materialise(
    model: nn.Module,
    checkpoint: Checkpoint,
    names: Mapping[str, str],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    blocks: Mapping[str, tuple[slice, ...]] | None = None,
) -> None:
    """Read, convert and assign each tensor of `names` (ours -> checkpoint's) in turn, or
    with `blocks` (ours -> index) only that block of it; a part of a fused projection (see
    models/fused_linear.py) is copied into its rows of the fused parameter, allocated when
    its first part arrives."""
    ours_of = {theirs: ours for ours, theirs in names.items()}
    fused_parts = part_slices(model)
    if blocks is None:
        reads = checkpoint.tensors(names.values())
    else:
        reads = checkpoint.slices({theirs: blocks[ours] for ours, theirs in names.items()})
    for theirs, tensor in reads:
        target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
        tensor = tensor.to(device=device, dtype=target_dtype)
        ours = ours_of[theirs]
        if ours not in fused_parts:
            assign(model, ours, tensor)
            continue
        fused_name, rows = fused_parts[ours]
        fused = model.get_parameter(fused_name)
        if fused.is_meta:
            assign(model, fused_name, torch.empty(fused.shape, dtype=target_dtype, device=device))
            fused = model.get_parameter(fused_name)
        with torch.no_grad():
            fused[rows].copy_(tensor)


def assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter or buffer `name` of `model` with `tensor` (any shape/dtype: already
    converted and checked), without copying it."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    old = getattr(module, leaf)
    if isinstance(old, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=old.requires_grad)
    setattr(module, leaf, tensor)


def _check_materialised(model: nn.Module) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"loading left tensors on the meta device: {left}")


def _write(
    tensors: Mapping[str, torch.Tensor],
    config: dict,
    out_dir: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = write_safetensors(tensors, out, max_shard_bytes=max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    logger.info("wrote %d tensors to %s in %d file(s)", len(tensors), out, len(files))
    return out
