"""`specrun export-onnx`: write the target forward (and a draft head's step) as ONNX graphs.

The model (and head) load in float32 on the CPU; the graphs and their manifests land in
`--out` (see runtime/graphs/onnx_export.py for their inputs, outputs and dynamic axes).
`--check` then runs each graph with ONNX Runtime on fresh random inputs, at shapes other than
the export examples, and compares it with PyTorch; the exit status is 1 if any output differs
by more than `--tolerance` times max(1, its largest PyTorch magnitude).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..models.config import DraftConfig
from ..models.default import default_model_dir
from ..models.loading import load_draft, load_target

if TYPE_CHECKING:
    from ..runtime.graphs.onnx_export import ExportedGraph

REQUIRED_PACKAGES = ("onnx", "onnxscript")
CHECK_PACKAGES = ("onnxruntime",)
DEFAULT_TOLERANCE = 1e-3


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-onnx", help="export the target forward and a draft-head step as ONNX graphs"
    )
    parser.add_argument("--model", default=None, help="HF Llama directory (default: embedded)")
    parser.add_argument(
        "--draft",
        default=None,
        help="EAGLE draft-head directory (without it the target keeps the default EAGLE-3 taps)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--opset", type=int, default=None, help="ONNX opset, 18 to 25 (default: 18)"
    )
    parser.add_argument(
        "--check", action="store_true", help="compare ONNX Runtime with PyTorch on random inputs"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="--check: largest max |diff| accepted, relative to max(1, max |value|)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _require_packages(REQUIRED_PACKAGES + (CHECK_PACKAGES if args.check else ()))
    from ..runtime.graphs import onnx_export  # needs onnx and onnxscript

    opset = onnx_export.DEFAULT_OPSET if args.opset is None else args.opset
    model_dir = args.model or default_model_dir()
    draft_config = DraftConfig.from_json(args.draft) if args.draft else None
    target = load_target(
        model_dir, dtype=torch.float32, device="cpu", tap_layers=_taps(draft_config)
    )
    head = load_draft(args.draft, target=target) if args.draft else None
    started = time.perf_counter()
    graphs = [onnx_export.export_target(target, args.out, opset=opset)]
    if head is not None:
        graphs += onnx_export.export_draft(head, args.out, opset=opset)
    for graph in graphs:
        print(f"wrote {graph.path}")
    print(
        f"exported {len(graphs)} graph(s) at opset {opset} in {time.perf_counter() - started:.1f} s"
    )
    if not args.check:
        return 0
    return 0 if _check(graphs, tolerance=args.tolerance) else 1


def _require_packages(names: tuple[str, ...]) -> None:
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f'{", ".join(missing)} not installed; install the ONNX extra: pip install -e ".[onnx]"'
        )


def _taps(draft_config: DraftConfig | None) -> tuple[int, ...] | None:
    """The target's tap layers: an EAGLE-3 head's own, none for other heads, the default
    EAGLE-3 taps (None) without a head."""
    if draft_config is None:
        return None
    if draft_config.kind != "eagle3":
        return ()
    return draft_config.tap_layers


def _check(graphs: list[ExportedGraph], *, tolerance: float) -> bool:
    """Print each output's max |diff| on random inputs; True if all are within tolerance."""
    from ..runtime.graphs.onnx_export import StepShapes, compare_with_onnxruntime, random_inputs

    shapes = StepShapes(batch=3, num_tokens=5, cache_size=11, num_side=4)
    all_close = True
    for graph in graphs:
        for diff in compare_with_onnxruntime(graph, random_inputs(graph, shapes, seed=1)):
            close = diff.max_abs_diff <= tolerance * max(1.0, diff.max_abs_value)
            all_close &= close
            print(
                f"{graph.name}.{diff.name}: max |diff| {diff.max_abs_diff:.3g} "
                f"(max |value| {diff.max_abs_value:.3g}){'' if close else '  TOO LARGE'}"
            )
    return all_close
