"""ONNX export of the target forward and the draft-head step, for runtimes outside PyTorch.

Graphs (each `<name>.onnx` with a `<name>.manifest.json` beside it):
  target         Llama forward serving both prefill (chain `anc`) and tree verify:
                 tokens, positions, k_cache, v_cache, cache_len, anc ->
                 logits, hidden, k_new, v_new (+ taps when the model has EAGLE-3 tap layers).
  draft          one DraftHead step as runtime/draft.py runs it (extend: empty side buffer,
                 N0 = 0; tree expansion: earlier levels' K/V in k_side / v_side):
                 tokens, features, positions, k_cache, v_cache, cache_len, anc, k_side,
                 v_side -> logits, hidden, k_new, v_new.
  draft_project  EAGLE-3 heads only: taps -> first-step features (`Eagle3Head.project`).
Batch, new tokens, cache capacity, side-buffer length and mask words are dynamic axes.
Committing k_new / v_new to the caches and mapping EAGLE-3 draft ids to target ids (`d2t`)
stay with the caller. Weights past 2 GB go to `<name>.onnx.data` beside the graph.

Mechanism: `torch.onnx.export(dynamo=True)` (torch.export, then onnxscript's torchlib; needs
the `onnxscript` package), the exporter PyTorch maintains. The TorchScript exporter
(`dynamo=False`) is deprecated and turns `>>` on int64 into a truncating division, which
misreads ancestor words with bit 63 set; torchlib has no signed `>>` at all (ONNX BitShift is
unsigned-only), so `aten.__rshift__` is given an exact arithmetic shift built from unsigned
shifts (`_rshift_int64`). Attention is the decomposed reference of models/attention.py (mask +
SDPA), not the Triton op. Each dynamic axis is traced from an example of size >= 2
(torch.export specialises sizes 0 and 1), with 65 tree keys so that the ancestor bitmask has
two words; the graphs run at any size (tested down to 1, and with an empty side buffer).
Opsets 18 to 25 export; from 23 the graphs use ONNX's own Attention and RMSNormalization ops.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from onnxscript import opset18 as op
from torch import nn
from torch.export import Dim

from ...models.attention import BITS_PER_WORD, pack_ancestor_mask
from ...models.config import LlamaConfig
from ...models.eagle import NUM_EAGLE3_TAPS, DraftHead, Eagle3Head
from ...models.llama import AttentionInputs, Llama

logger = logging.getLogger(__name__)

MIN_OPSET = 18  # BitwiseNot, used by the int64 right shift
# From 26 on, the version converter (onnxscript 0.7, onnx 1.23) leaves a model that fails the
# checker.
MAX_OPSET = 25
DEFAULT_OPSET = 18
MANIFEST_FORMAT = 1
SIDE_INPUTS = ("k_side", "v_side")
STEP_OUTPUTS = ("logits", "hidden", "k_new", "v_new")


@dataclass(frozen=True)
class StepShapes:
    """Sizes of one step's inputs: slots, new tokens per slot, cache capacity, side nodes."""

    batch: int
    num_tokens: int
    cache_size: int
    num_side: int = 0


# Every dynamic size >= 2, and num_side + num_tokens > 64 so that `anc` has two words.
TARGET_EXPORT_SHAPES = StepShapes(batch=2, num_tokens=BITS_PER_WORD + 1, cache_size=7)
DRAFT_EXPORT_SHAPES = StepShapes(batch=2, num_tokens=3, cache_size=7, num_side=BITS_PER_WORD - 1)


class TargetStep(nn.Module):
    """The target forward with flat tensor inputs and outputs (what the exporter traces)."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.model = model

    @property
    def output_names(self) -> tuple[str, ...]:
        return (*STEP_OUTPUTS, "taps") if self.model.tap_layers else STEP_OUTPUTS

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_len: torch.Tensor,
        anc: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """tokens, positions: [B, T] int64; k_cache, v_cache: [L, B, Hkv, S, D] float;
        cache_len: [B] int64; anc: [B, T, W] int64 ancestor bitmask over the T new tokens.
        Returns logits [B, T, V], hidden [B, T, H], k_new, v_new [L, B, Hkv, T, D] and, with
        tap layers, taps [B, T, num_taps * H]."""
        attn = AttentionInputs(k_cache, v_cache, cache_len, anc)
        out = self.model(tokens, positions, attn)
        logits = self.model.logits(out.hidden)
        taps = () if out.taps is None else (out.taps,)
        return logits, out.hidden, out.k_new, out.v_new, *taps


class DraftStep(nn.Module):
    """One draft-head forward over the head's cache and a (possibly empty) side buffer."""

    output_names = STEP_OUTPUTS

    def __init__(self, head: DraftHead) -> None:
        super().__init__()
        self.head = head

    def forward(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_len: torch.Tensor,
        anc: torch.Tensor,
        k_side: torch.Tensor,
        v_side: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """tokens, positions: [B, T] int64; features: [B, T, H] float; k_cache, v_cache:
        [L, B, Hkv, S, D]; cache_len: [B] int64; k_side, v_side: [L, B, Hkv, N0, D] (N0 may
        be 0); anc: [B, T, W] int64 over the N0 + T tree keys (side buffer, then new tokens).
        Returns logits [B, T, V_draft], hidden [B, T, H], k_new, v_new [L, B, Hkv, T, D]."""
        attn = AttentionInputs(k_cache, v_cache, cache_len, anc, k_side, v_side)
        out = self.head(tokens, features, positions, attn)
        return out.logits, out.hidden, out.k_new, out.v_new


class DraftProject(nn.Module):
    """EAGLE-3 first-step features from the target's taps."""

    output_names = ("features",)

    def __init__(self, head: Eagle3Head) -> None:
        super().__init__()
        self.head = head

    def forward(self, taps: torch.Tensor) -> torch.Tensor:
        """taps: [B, T, 3 * target_H] float. Returns features [B, T, H]."""
        return self.head.project(taps)


@dataclass(frozen=True)
class ExportedGraph:
    """One exported graph: the module it was traced from, its file and its manifest."""

    name: str
    step: nn.Module
    path: Path
    manifest: dict[str, Any]


@dataclass(frozen=True)
class OutputDiff:
    """How far one ONNX Runtime output is from PyTorch's: max |diff| and max |PyTorch value|."""

    name: str
    max_abs_diff: float
    max_abs_value: float


def export_target(
    model: Llama, out_dir: str | Path, *, opset: int = DEFAULT_OPSET
) -> ExportedGraph:
    """Export `model` (float, on CPU) as `out_dir/target.onnx` + `target.manifest.json`."""
    step = TargetStep(model).eval()
    inputs = target_inputs(model, TARGET_EXPORT_SHAPES)
    config = model.config.to_hf() | {"tap_layers": list(model.tap_layers)}
    return _export(step, inputs, Path(out_dir), name="target", opset=opset, config=config)


def export_draft(
    head: DraftHead, out_dir: str | Path, *, opset: int = DEFAULT_OPSET
) -> list[ExportedGraph]:
    """Export a head's step as `out_dir/draft.onnx` (+ `draft_project.onnx` for EAGLE-3),
    each with its manifest. The target's borrowed embedding / lm_head are baked in."""
    out, config = Path(out_dir), head.config.to_hf()
    step = DraftStep(head).eval()
    inputs = draft_inputs(head, DRAFT_EXPORT_SHAPES)
    graphs = [_export(step, inputs, out, name="draft", opset=opset, config=config)]
    if isinstance(head, Eagle3Head):
        project = DraftProject(head).eval()
        taps = project_inputs(head, DRAFT_EXPORT_SHAPES)
        graphs.append(_export(project, taps, out, name="draft_project", opset=opset, config=config))
    return graphs


def compare_with_onnxruntime(
    graph: ExportedGraph, inputs: dict[str, torch.Tensor]
) -> list[OutputDiff]:
    """Run `graph` with ONNX Runtime (CPU) and its PyTorch module on `inputs` (CPU tensors,
    as random_inputs makes them); one OutputDiff per output."""
    import onnxruntime  # only checking needs it

    session = onnxruntime.InferenceSession(str(graph.path), providers=["CPUExecutionProvider"])
    got = session.run(None, {name: tensor.numpy() for name, tensor in inputs.items()})
    with torch.no_grad():
        want = graph.step(*inputs.values())
    want = want if isinstance(want, tuple) else (want,)
    return [
        OutputDiff(
            name, float((torch.from_numpy(ours) - theirs).abs().max()), float(theirs.abs().max())
        )
        for name, ours, theirs in zip(graph.step.output_names, got, want, strict=True)
    ]


def random_inputs(
    graph: ExportedGraph, shapes: StepShapes, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random inputs of any exported graph (target_inputs, draft_inputs or project_inputs)."""
    step = graph.step
    if isinstance(step, TargetStep):
        return target_inputs(step.model, shapes, seed=seed)
    if isinstance(step, DraftStep):
        return draft_inputs(step.head, shapes, seed=seed)
    return project_inputs(step.head, shapes, seed=seed)


def target_inputs(model: Llama, shapes: StepShapes, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs of the target graph, keyed and ordered as TargetStep.forward's: a random
    tree per slot, ragged cache lengths in [0, cache_size], positions after the cache."""
    generator = torch.Generator().manual_seed(seed)
    dtype = model.lm_head.weight.dtype
    return _step_inputs(model.config, len(model.layers), shapes, dtype, generator=generator)


def draft_inputs(head: DraftHead, shapes: StepShapes, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs of the draft graph, keyed and ordered as DraftStep.forward's; the side
    buffer holds `shapes.num_side` earlier nodes."""
    generator = torch.Generator().manual_seed(seed)
    dtype, layer = head.fc.weight.dtype, head.config.layer
    inputs = _step_inputs(layer, head.num_layers, shapes, dtype, generator=generator)
    features_shape = (shapes.batch, shapes.num_tokens, head.config.hidden_size)
    features = torch.randn(features_shape, generator=generator, dtype=dtype)
    side_shape = (
        head.num_layers,
        shapes.batch,
        layer.num_kv_heads,
        shapes.num_side,
        layer.head_dim,
    )
    side = {name: torch.randn(side_shape, generator=generator, dtype=dtype) for name in SIDE_INPUTS}
    return {"tokens": inputs.pop("tokens"), "features": features} | inputs | side


def project_inputs(
    head: Eagle3Head, shapes: StepShapes, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random taps [B, T, 3 * target_H] for the EAGLE-3 draft_project graph."""
    generator = torch.Generator().manual_seed(seed)
    width = NUM_EAGLE3_TAPS * head.config.feature_size
    taps_shape = (shapes.batch, shapes.num_tokens, width)
    return {"taps": torch.randn(taps_shape, generator=generator, dtype=head.fc.weight.dtype)}


def random_tree_ancestors(
    shapes: StepShapes, *, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree per slot over its new tokens, each node also seeing random side keys.

    Node 0 is the root; node i > 0 descends from a random node < i and sees its ancestors and
    itself. Returns anc [B, T, W] int64 over the N0 + T tree keys and depth [B, T] int64.
    """
    batch, num_tokens, num_side = shapes.batch, shapes.num_tokens, shapes.num_side
    visible = torch.zeros(batch, num_tokens, num_side + num_tokens, dtype=torch.bool)
    visible[..., :num_side] = torch.rand(batch, num_tokens, num_side, generator=generator) < 0.5
    rows = torch.arange(batch)
    for node in range(num_tokens):
        if node:
            parent = torch.randint(0, node, (batch,), generator=generator)
            visible[:, node, num_side:] = visible[rows, parent, num_side:]
        visible[:, node, num_side + node] = True
    depth = visible[..., num_side:].sum(-1) - 1
    return pack_ancestor_mask(visible), depth


def _step_inputs(
    layer: LlamaConfig,
    num_layers: int,
    shapes: StepShapes,
    dtype: torch.dtype,
    *,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """tokens, positions, caches (random beyond cache_len too: never read), cache_len, anc."""
    batch, num_tokens = shapes.batch, shapes.num_tokens
    cache_shape = (num_layers, batch, layer.num_kv_heads, shapes.cache_size, layer.head_dim)
    cache_len = torch.randint(0, shapes.cache_size + 1, (batch,), generator=generator)
    anc, depth = random_tree_ancestors(shapes, generator=generator)
    return {
        "tokens": torch.randint(0, layer.vocab_size, (batch, num_tokens), generator=generator),
        "positions": cache_len[:, None] + shapes.num_side + depth,
        "k_cache": torch.randn(cache_shape, generator=generator, dtype=dtype),
        "v_cache": torch.randn(cache_shape, generator=generator, dtype=dtype),
        "cache_len": cache_len,
        "anc": anc,
    }


def _rshift_int64(x, shift):
    """ONNX arithmetic `x >> shift` on int64, from logical shifts of x, or of ~x when x < 0
    (then x >> s == ~(~x >> s), and ~x is non-negative). Traced by the exporter."""
    uint64, int64 = onnx.TensorProto.UINT64, onnx.TensorProto.INT64
    unsigned, amount = op.Cast(x, to=uint64), op.Cast(shift, to=uint64)
    logical = op.Cast(op.BitShift(unsigned, amount, direction="RIGHT"), to=int64)
    inverted = op.BitShift(op.BitwiseNot(unsigned), amount, direction="RIGHT")
    negative = op.BitwiseNot(op.Cast(inverted, to=int64))
    return op.Where(op.Less(x, op.Constant(value_int=0)), negative, logical)


def _dynamic_axes(names: tuple[str, ...]) -> dict[str, dict[int, Dim]]:
    """Dynamic axes of each named input; inputs share an axis by sharing its Dim."""
    batch, tokens, cache = Dim("batch"), Dim("tokens"), Dim("cache")
    words, side = Dim("mask_words"), Dim("side")
    axes = {
        "tokens": {0: batch, 1: tokens},
        "features": {0: batch, 1: tokens},
        "positions": {0: batch, 1: tokens},
        "k_cache": {1: batch, 3: cache},
        "v_cache": {1: batch, 3: cache},
        "cache_len": {0: batch},
        "anc": {0: batch, 1: tokens, 2: words},
        "k_side": {1: batch, 3: side},
        "v_side": {1: batch, 3: side},
        "taps": {0: batch, 1: tokens},
    }
    return {name: axes[name] for name in names}


def _export(
    step: nn.Module,
    inputs: dict[str, torch.Tensor],
    out_dir: Path,
    *,
    name: str,
    opset: int,
    config: dict[str, Any],
) -> ExportedGraph:
    """Trace `step` on the example `inputs`, save, check and describe it."""
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset {opset} is not supported: use one in [{MIN_OPSET}, {MAX_OPSET}]")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.onnx"
    with warnings.catch_warnings():
        # Inputs sharing a dynamic axis make the exporter warn once per extra use of its name.
        warnings.filterwarnings("ignore", message=r"# The axis name", category=UserWarning)
        program = torch.onnx.export(
            step,
            tuple(inputs.values()),
            dynamo=True,
            input_names=list(inputs),
            output_names=list(step.output_names),
            dynamic_shapes=_dynamic_axes(tuple(inputs)),
            opset_version=opset,
            custom_translation_table={torch.ops.aten.__rshift__.Tensor: _rshift_int64},
            verbose=False,
        )
    program.save(str(path))
    onnx.checker.check_model(str(path), full_check=True)
    manifest = _manifest(path, name=name, opset=opset, config=config)
    path.with_suffix(".manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info("exported %s to %s", name, path)
    return ExportedGraph(name, step, path, manifest)


def _manifest(path: Path, *, name: str, opset: int, config: dict[str, Any]) -> dict[str, Any]:
    """Graph name, opset, input/output names, dtypes and shapes (a string per dynamic axis)
    as the saved file declares them, and a hash of the model config."""
    graph = onnx.load(str(path), load_external_data=False).graph
    canonical = json.dumps(config, sort_keys=True).encode()
    return {
        "format": MANIFEST_FORMAT,
        "graph": name,
        "opset": opset,
        "exporter": f"torch.onnx.export(dynamo=True), torch {torch.__version__}",
        "inputs": [_describe(value) for value in graph.input],
        "outputs": [_describe(value) for value in graph.output],
        "config_sha256": hashlib.sha256(canonical).hexdigest(),
    }


def _describe(value: onnx.ValueInfoProto) -> dict[str, Any]:
    tensor_type = value.type.tensor_type
    shape = [dim.dim_param or dim.dim_value for dim in tensor_type.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
    return {"name": value.name, "dtype": dtype, "shape": shape}
