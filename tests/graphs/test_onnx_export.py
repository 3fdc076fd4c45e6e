"""ONNX export of the target forward and the draft-head step, run with ONNX Runtime.

Tiny random models (GQA, two layers) are exported once per module at the example shapes, then
run at other shapes (batch, new tokens, cache capacity, side-buffer length and mask words all
differ, down to size 1 and an empty side buffer) with tree-shaped ancestor masks and ragged
cache lengths, and compared with the PyTorch models called directly. The CLI runs end to end
on a saved one-layer model with tied embeddings and an EAGLE-3 head.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnxruntime

from specrun.models.attention import chain_ancestors, pack_ancestor_mask
from specrun.models.llama import AttentionInputs
from specrun.models.loading import save_draft, save_target
from specrun.runtime.graphs import onnx_export
from specrun.tools.cli import main
from tiny_models import random_head, random_llama, tiny_config

ATOL = 1e-4
# Node i's parent; each slot of a batch uses the tree, the chain-with-branches, or a star.
TREES = ([-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 2, 4, 0], [-1, 0, 0, 0, 0, 0, 0])


@pytest.fixture(scope="module")
def target():
    return random_llama(tiny_config(num_layers=2), seed=0)


@pytest.fixture(scope="module")
def target_graph(target, tmp_path_factory):
    return onnx_export.export_target(target, tmp_path_factory.mktemp("onnx-target"))


@pytest.fixture(scope="module", params=["eagle3", "eagle1"])
def head_graphs(request, target, tmp_path_factory):
    head = random_head(request.param, target, seed=1)
    out = tmp_path_factory.mktemp(f"onnx-{request.param}")
    return head, {graph.name: graph for graph in onnx_export.export_draft(head, out)}


def _tree_ancestors(parents: list[int], *, num_side: int, side_bits: torch.Tensor):
    """anc [T, W] int64 over [side | new] keys and depth [T] of one tree given by `parents`;
    side_bits [T, num_side] bool: which side keys each node sees."""
    num_nodes = len(parents)
    visible = torch.zeros(num_nodes, num_side + num_nodes, dtype=torch.bool)
    visible[:, :num_side] = side_bits
    for node, parent in enumerate(parents):
        if parent >= 0:
            visible[node, num_side:] = visible[parent, num_side:]
        visible[node, num_side + node] = True
    return pack_ancestor_mask(visible), visible[:, num_side:].sum(-1) - 1


def _tree_batch(*, num_side: int, seed: int):
    """anc [3, 7, W] and depth [3, 7] of the three TREES, with random side-key visibility."""
    generator = torch.Generator().manual_seed(seed)
    side_bits = torch.rand(len(TREES), len(TREES[0]), num_side, generator=generator) < 0.5
    pairs = [
        _tree_ancestors(parents, num_side=num_side, side_bits=bits)
        for parents, bits in zip(TREES, side_bits, strict=True)
    ]
    return torch.stack([anc for anc, _ in pairs]), torch.stack([depth for _, depth in pairs])


def _caches(num_layers: int, batch: int, capacity: int, *, seed: int):
    generator = torch.Generator().manual_seed(seed)
    config = tiny_config()
    shape = (num_layers, batch, config.num_kv_heads, capacity, config.head_dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _run(graph, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    session = onnxruntime.InferenceSession(str(graph.path), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {name: t.numpy() for name, t in inputs.items()})
    names = [value.name for value in session.get_outputs()]
    return {name: torch.from_numpy(value) for name, value in zip(names, outputs, strict=True)}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        torch.testing.assert_close(got[name], tensor, atol=ATOL, rtol=0, msg=name)


def _target_case(case: str):
    """(tokens, positions, cache_len, anc, capacity): a 3-slot tree verify or a 1-slot
    70-token prompt chunk (two mask words, bit 63 set: a negative int64 word)."""
    if case == "tree":
        anc, depth = _tree_batch(num_side=0, seed=0)
        cache_len = torch.tensor([0, 5, 13])
        tokens = torch.tensor([[3, 14, 15, 92, 65, 35, 89]] * 3) + torch.arange(3)[:, None]
        return tokens, cache_len[:, None] + depth, cache_len, anc, 13
    num_tokens = 70
    positions = 2 + torch.arange(num_tokens)[None]
    tokens = torch.arange(num_tokens)[None] % 97
    return tokens, positions, torch.tensor([2]), chain_ancestors(1, num_tokens, "cpu"), 3


@pytest.mark.parametrize("case", ["tree", "long_chain"])
def test_target_graph_matches_pytorch(target, target_graph, case):
    tokens, positions, cache_len, anc, capacity = _target_case(case)
    k_cache, v_cache = _caches(2, tokens.shape[0], capacity, seed=1)
    inputs = {"tokens": tokens, "positions": positions, "k_cache": k_cache, "v_cache": v_cache}
    got = _run(target_graph, inputs | {"cache_len": cache_len, "anc": anc})
    with torch.no_grad():
        out = target(tokens, positions, AttentionInputs(k_cache, v_cache, cache_len, anc))
    want = {"logits": target.logits(out.hidden), "hidden": out.hidden, "k_new": out.k_new}
    _assert_close(got, want | {"v_new": out.v_new, "taps": out.taps})


@pytest.mark.parametrize("num_side", [0, 4])
def test_draft_graph_matches_pytorch(head_graphs, num_side):
    head, graphs = head_graphs
    anc, depth = _tree_batch(num_side=num_side, seed=2)
    batch, num_tokens = depth.shape
    generator = torch.Generator().manual_seed(3)
    cache_len = torch.tensor([1, 9, 4])
    k_cache, v_cache = _caches(head.num_layers, batch, 9, seed=4)
    k_side, v_side = _caches(head.num_layers, batch, num_side, seed=5)
    tokens = torch.randint(0, 97, (batch, num_tokens), generator=generator)
    features = torch.randn(batch, num_tokens, head.config.hidden_size, generator=generator)
    positions = cache_len[:, None] + num_side + depth
    inputs = {"tokens": tokens, "features": features, "positions": positions}
    inputs |= {"k_cache": k_cache, "v_cache": v_cache, "cache_len": cache_len, "anc": anc}
    got = _run(graphs["draft"], inputs | {"k_side": k_side, "v_side": v_side})
    sides = (k_side, v_side) if num_side else (None, None)
    attn = AttentionInputs(k_cache, v_cache, cache_len, anc, *sides)
    with torch.no_grad():
        out = head(tokens, features, positions, attn)
    _assert_close(
        got, {"logits": out.logits, "hidden": out.hidden, "k_new": out.k_new, "v_new": out.v_new}
    )


def test_eagle3_project_graph_matches_pytorch(head_graphs):
    head, graphs = head_graphs
    assert ("draft_project" in graphs) == (head.config.kind == "eagle3")
    if "draft_project" not in graphs:
        return
    generator = torch.Generator().manual_seed(6)
    taps = torch.randn(1, 9, 3 * head.config.feature_size, generator=generator)
    with torch.no_grad():
        want = head.project(taps)
    _assert_close(_run(graphs["draft_project"], {"taps": taps}), {"features": want})


def test_manifest_describes_dynamic_axes(target_graph):
    manifest = json.loads(target_graph.path.with_suffix(".manifest.json").read_text())
    assert manifest == target_graph.manifest
    assert manifest["graph"] == "target" and manifest["opset"] == onnx_export.DEFAULT_OPSET
    shapes = {value["name"]: value["shape"] for value in manifest["inputs"] + manifest["outputs"]}
    assert shapes["anc"] == ["batch", "tokens", "mask_words"]
    assert shapes["k_cache"] == [2, "batch", 2, "cache", 8]
    assert shapes["logits"] == ["batch", "tokens", 97]
    assert [value["name"] for value in manifest["outputs"]] == [
        "logits",
        "hidden",
        "k_new",
        "v_new",
        "taps",
    ]
    assert len(manifest["config_sha256"]) == 64


def test_cli_exports_and_checks_a_saved_model(tmp_path, capsys):
    target = random_llama(tiny_config(num_layers=1, tie_word_embeddings=True), seed=2)
    model_dir = save_target(target, tmp_path / "model")
    draft_dir = save_draft(random_head("eagle3", target, seed=3), tmp_path / "head")
    out = tmp_path / "onnx"
    argv = ["export-onnx", "--model", str(model_dir), "--draft", str(draft_dir)]
    assert main([*argv, "--out", str(out), "--check"]) == 0
    names = ("target", "draft", "draft_project")
    assert all((out / f"{name}.onnx").is_file() for name in names)
    assert all((out / f"{name}.manifest.json").is_file() for name in names)
    report = capsys.readouterr().out
    assert report.count("max |diff|") == 5 + 4 + 1 and "TOO LARGE" not in report


def test_cli_errors_name_the_fix(tmp_path, capsys, monkeypatch):
    model_dir = save_target(random_llama(tiny_config(), seed=0), tmp_path / "model")
    argv = ["export-onnx", "--model", str(model_dir), "--out", str(tmp_path / "onnx")]
    assert main([*argv, "--opset", "17"]) == 2
    assert "use one in [18, 25]" in capsys.readouterr().err
    installed = importlib.util.find_spec

    def without_onnxscript(name):
        return None if name == "onnxscript" else installed(name)

    monkeypatch.setattr(importlib.util, "find_spec", without_onnxscript)
    assert main(argv) == 2
    assert 'pip install -e ".[onnx]"' in capsys.readouterr().err
