"""The tree-attention fusion on real model graphs.

It fires once per attention layer of the target (tree verify, dynamic-length chain prefill)
and of the draft heads (EAGLE-1; EAGLE-3 with a side buffer, M queries over N != M tree keys),
whichever SDPA lowering the trace picked (CPU flash kernel, or the math fallback with GQA and
a bf16 upcast as CUDA uses it); the compiled graph keeps no mask, equals eager, and plain
attention or a near-miss of the tree mask is left alone. GPU tier: bf16 on CUDA, Triton op.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from specrun.models.attention import chain_ancestors, expand_ancestor_mask, pack_ancestor_mask
from specrun.models.attention import tree_attention as model_tree_attention
from specrun.models.llama import AttentionInputs
from specrun.runtime.graphs import compile_draft, compile_prefill, compile_step, compile_verify
from specrun.runtime.kv_cache import KVCache
from specrun.runtime.passes import GraphPass, PassManager
from specrun.runtime.passes.tree_attention import TreeAttentionFusion
from tiny_models import assert_step_close, random_head, random_llama, tiny_config

# Every compile must really run: cached graphs would skip the passes.
pytestmark = pytest.mark.usefixtures("uncached_compiles")

# Parent of each node of a 6-node tree (node 0 = root): two branches of depth 2 and 3.
TREE_PARENTS = [0, 0, 0, 1, 2, 3]


class Census(GraphPass):
    """Records the ops of the graph as the passes before it left it."""

    name = "census"

    def __init__(self) -> None:
        self.targets: set[object] = set()

    def __call__(self, graph: fx.Graph) -> int:
        self.targets |= {node.target for node in graph.nodes if node.op == "call_function"}
        return 0


def _manager() -> tuple[PassManager, Census]:
    census = Census()
    return PassManager([TreeAttentionFusion(), census]), census


def _assert_mask_gone(census: Census) -> None:
    assert torch.ops.rt.tree_attention.default in census.targets
    leftovers = {str(t) for t in census.targets if "scaled_dot_product" in str(t)}
    assert not leftovers and torch.ops.aten.__rshift__.Tensor not in census.targets


def _assert_output_copies_dropped(manager: PassManager, num_layers: int) -> None:
    """The op writes [B, M, Hq, D] memory: the trace's copy of SDPA's [B, Hq, M, D] output
    into that order (M > 1) is gone from every layer."""
    assert manager.passes[0].num_output_copies_dropped == num_layers


def _tree_anc(batch: int, parents: list[int]) -> torch.Tensor:
    num_nodes = len(parents)
    visible = torch.eye(num_nodes, dtype=torch.bool)
    for node in range(1, num_nodes):
        visible[node] |= visible[parents[node]]
    return pack_ancestor_mask(visible).expand(batch, -1, -1)


def _cache(config, *, lengths, capacity=16, num_layers=None, dtype=torch.float32, device="cpu"):
    cache = KVCache.allocate(
        config,
        num_layers=num_layers,
        batch_size=len(lengths),
        capacity=capacity,
        dtype=dtype,
        device=device,
    )
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths.copy_(torch.tensor(lengths))
    return cache


def _verify_inputs(config, *, dtype=torch.float32, device="cpu"):
    cache = _cache(config, lengths=[5, 9], dtype=dtype, device=device)
    depth = torch.tensor([0, 1, 1, 2, 2, 3], device=device)
    tokens = torch.randint(0, config.vocab_size, (2, len(TREE_PARENTS)), device=device)
    anc = _tree_anc(2, TREE_PARENTS).to(device)
    return tokens, cache.lengths[:, None] + depth, cache.attention_inputs(anc)


def test_fuses_every_target_layer_of_a_tree_verify():
    torch.manual_seed(0)
    target = random_llama(tiny_config(), dtype=torch.float32)
    manager, census = _manager()
    step = compile_verify(target, manager=manager)
    inputs = _verify_inputs(target.config)
    assert_step_close(step(*inputs), target(*inputs), atol=1e-5, rtol=1e-5)
    assert manager.stats["tree_attention"] == target.config.num_layers
    assert manager.passes[0].num_fused_by_form == {"flash_attention_for_cpu": 2}
    _assert_mask_gone(census)
    _assert_output_copies_dropped(manager, target.config.num_layers)


def test_fuses_the_math_lowering():
    """What CUDA traces for a masked GQA call: GQA repeat, matmuls, safe softmax, bf16 upcast."""
    torch.manual_seed(0)
    target = random_llama(tiny_config(num_layers=1), dtype=torch.bfloat16)
    manager, census = _manager()
    step = compile_verify(target, manager=manager)
    inputs = _verify_inputs(target.config, dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.MATH]):
        got = step(*inputs)
        want = target(*inputs)
    assert_step_close(got, want, atol=3e-2, rtol=3e-2)
    assert manager.passes[0].num_fused_by_form == {"math": 1}
    _assert_mask_gone(census)
    _assert_output_copies_dropped(manager, 1)


def test_fuses_a_dynamic_length_chain_prefill_without_recompiling():
    torch.manual_seed(0)
    target = random_llama(tiny_config(num_layers=1), dtype=torch.float32)
    cache = _cache(target.config, lengths=[0, 3])
    step = compile_prefill(target)
    for length in (5, 3):
        tokens = torch.randint(0, target.config.vocab_size, (2, length))
        positions = cache.lengths[:, None] + torch.arange(length)
        attn = cache.attention_inputs(chain_ancestors(2, length, "cpu"))
        got, want = step(tokens, positions, attn), target(tokens, positions, attn)
        assert_step_close(got, want, atol=1e-5, rtol=1e-5)
    assert step.num_compiles == 1
    assert step.manager.stats["tree_attention"] == target.config.num_layers
    # Dynamic shapes: one launch config, so one kernel variant serves every length.
    assert step.manager.passes[0].num_fixed_config == target.config.num_layers
    _assert_output_copies_dropped(step.manager, target.config.num_layers)


@pytest.mark.parametrize(
    ("kind", "num_side", "num_layers"), [("eagle1", 0, 1), ("eagle3", 2, 1), ("eagle3", 2, 2)]
)
def test_fuses_draft_heads_including_a_side_buffer(kind, num_side, num_layers):
    """EAGLE-3 expands 2 frontier nodes that see 2 earlier side-buffer nodes: M=2, N=4."""
    torch.manual_seed(0)
    target = random_llama(tiny_config(), dtype=torch.float32)
    head = random_head(kind, target, num_layers=num_layers)
    cache = _cache(target.config, lengths=[4, 7], num_layers=head.num_layers)
    num_new = 2 if num_side else 3
    visible = torch.ones(2, num_new, num_side + num_new, dtype=torch.bool).tril(num_side)
    attn = AttentionInputs(cache.k, cache.v, cache.lengths, pack_ancestor_mask(visible))
    if num_side:
        side_shape = (head.num_layers, 2, target.config.num_kv_heads, num_side, 8)
        attn.k_side, attn.v_side = torch.randn(side_shape), torch.randn(side_shape)
    tokens = torch.randint(0, target.config.vocab_size, (2, num_new))
    features = torch.randn(2, num_new, target.config.hidden_size)
    positions = cache.lengths[:, None] + torch.arange(num_new)
    manager, census = _manager()
    step = compile_draft(head, manager=manager)
    got, want = step(tokens, features, positions, attn), head(tokens, features, positions, attn)
    for name in ("hidden", "logits", "k_new", "v_new"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5)
    assert manager.stats["tree_attention"] == head.num_layers
    _assert_mask_gone(census)
    _assert_output_copies_dropped(manager, head.num_layers)


def _efficient_lowering(q, k, v, mask):
    """How SDPA's CUDA dispatch calls efficient attention: the bool mask as
    where(~mask, -inf, 0), broadcast to [B, H, M, L], padded to a multiple of 16 and sliced
    back (the kernel's alignment)."""
    bias = torch.where(mask.logical_not(), -math.inf, torch.scalar_tensor(0.0, dtype=q.dtype))
    length = bias.shape[-1]
    bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], length)
    bias = F.pad(bias, (0, 16 - length % 16))[..., :length]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, scale=0.3)


def _cudnn_lowering(q, k, v, mask):
    """How SDPA's CUDA dispatch calls cuDNN attention (torch 2.10 / 2.11, as seen on an H100):
    the bool mask as where(~mask, -65504, 0), GQA left to the kernel."""
    bias = torch.where(mask.logical_not(), -65504.0, torch.scalar_tensor(0.0, dtype=q.dtype))
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, scale=0.3)


def _cudnn_bf16_lowering(q, k, v, mask):
    """The cuDNN lowering as Inductor constant-folds it in bf16: -65504 stored as -65536."""
    bias = torch.where(
        mask.logical_not(),
        torch.full((), -65536.0, dtype=q.dtype),
        torch.scalar_tensor(0.0, dtype=q.dtype),
    )
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False, scale=0.3)


def _cuda_lowering(fused_attention):
    """The reference with SDPA replaced by what CUDA's dispatcher writes for a fused kernel."""

    def attention(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc):
        num_queries = q.shape[2]
        prefix = (torch.arange(k_cache.shape[2])[None, :] < cache_len[:, None])[:, None, :]
        mask = torch.cat(
            [prefix.expand(-1, num_queries, -1), expand_ancestor_mask(anc, k_tree.shape[2])], -1
        )
        k, v = torch.cat([k_cache, k_tree], 2), torch.cat([v_cache, v_tree], 2)
        return fused_attention(q, k, v, mask[:, None])[0]

    return attention


@pytest.mark.parametrize(
    ("lowering", "num_kv_heads", "dtype"),
    [
        (_efficient_lowering, 4, torch.float32),
        (_cudnn_lowering, 2, torch.float32),
        (_cudnn_bf16_lowering, 2, torch.bfloat16),
    ],
    ids=["efficient", "cudnn", "cudnn-bf16"],
)
def test_fuses_the_cuda_fused_lowerings(lowering, num_kv_heads, dtype):
    """Traced on fake CPU tensors (no CUDA needed); after the pass the graph runs on the CPU."""
    torch.manual_seed(0)
    args = (
        torch.randn(2, 4, 3, 8, dtype=dtype),
        torch.randn(2, num_kv_heads, 10, 8, dtype=dtype),
        torch.randn(2, num_kv_heads, 10, 8, dtype=dtype),
        torch.tensor([4, 6]),
        torch.randn(2, num_kv_heads, 3, 8, dtype=dtype),
        torch.randn(2, num_kv_heads, 3, 8, dtype=dtype),
        _tree_anc(2, [0, 0, 1]),
    )
    graph_module = make_fx(
        _cuda_lowering(lowering), decomposition_table=select_decomp_table(), tracing_mode="fake"
    )(*args)
    fusion = TreeAttentionFusion()
    assert fusion(graph_module.graph) == 1
    graph_module.graph.eliminate_dead_code()
    graph_module.recompile()
    assert not any("scaled_dot_product" in str(node.target) for node in graph_module.graph.nodes)
    want = model_tree_attention(*args, scale=0.3)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(graph_module(*args), want, atol=tolerance, rtol=tolerance)


def _near_miss(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc):
    """The reference with `<=` for `<` in the prefix mask: one cache position too many."""
    positions = torch.arange(k_cache.shape[2])
    prefix = (positions[None, :] <= cache_len[:, None])[:, None, :]
    key = torch.arange(k_tree.shape[2])
    tree = ((anc[..., key // 64] >> (key % 64)) & 1).bool()
    mask = torch.cat([prefix.expand(-1, q.shape[2], -1), tree], dim=-1)
    k, v = torch.cat([k_cache, k_tree], 2), torch.cat([v_cache, v_tree], 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


def _causal(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc):
    """Plain causal attention over the tree keys (no cache, no bitmask)."""
    mask = torch.ones(q.shape[2], k_tree.shape[2], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k_tree, v_tree, attn_mask=mask, enable_gqa=True)


def _causal_flag(q, k_cache, v_cache, cache_len, k_tree, v_tree, anc):
    """Causal attention by flag over the tree keys: a fused call `match_sdpa` does not read
    (it takes an explicit mask only), counted all the same."""
    return F.scaled_dot_product_attention(q[:, : k_tree.shape[1]], k_tree, v_tree, is_causal=True)


@pytest.mark.parametrize("attention", [_near_miss, _causal, _causal_flag])
def test_leaves_other_attention_alone(attention):
    torch.manual_seed(0)
    args = (
        torch.randn(2, 4, 3, 8),
        torch.randn(2, 2, 10, 8),
        torch.randn(2, 2, 10, 8),
        torch.tensor([4, 6]),
        torch.randn(2, 2, 3, 8),
        torch.randn(2, 2, 3, 8),
        chain_ancestors(2, 3, "cpu"),
    )
    step = compile_step(attention, name="other")
    torch.testing.assert_close(step(*args), attention(*args), atol=1e-5, rtol=1e-5)
    assert step.manager.stats["tree_attention"] == 0
    # The call is seen and left alone for a stated reason.
    assert sum(step.manager.passes[0].num_unfused_by_reason.values()) == 1


class _SourcePass(GraphPass):
    name = "source"

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self, graph: fx.Graph) -> int:
        return 0

    def source_files(self) -> tuple[str, ...]:
        return (str(self.path),)


def test_uuid_is_stable_and_changes_with_the_passes(tmp_path):
    uuid = PassManager().uuid()
    assert isinstance(uuid, str) and uuid and uuid == PassManager().uuid() == PassManager().uuid()

    class Bumped(TreeAttentionFusion):
        version = 2

    assert PassManager([Bumped()]).uuid() != uuid
    source = tmp_path / "pass.py"
    source.write_text("v1")
    before = PassManager([TreeAttentionFusion(), _SourcePass(source)]).uuid()
    source.write_text("v2")
    after = PassManager([TreeAttentionFusion(), _SourcePass(source)]).uuid()
    assert len({uuid, before, after}) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_heads", [2, 4], ids=["gqa", "mha"])
def test_gpu_bf16_verify_fuses_and_matches_eager(num_kv_heads):
    torch.manual_seed(0)
    config = tiny_config(num_kv_heads=num_kv_heads, head_dim=16)
    target = random_llama(config, dtype=torch.bfloat16).cuda()
    manager, census = _manager()
    step = compile_verify(target, manager=manager)
    inputs = _verify_inputs(config, dtype=torch.bfloat16, device="cuda")
    got, want = step(*inputs), target(*inputs)
    forms = dict(manager.passes[0].num_fused_by_form)
    print(f"kv heads {num_kv_heads}: fused {forms}")
    ops = sorted(str(op) for op in census.targets)
    assert manager.stats["tree_attention"] == config.num_layers, (forms, ops)
    _assert_mask_gone(census)
    _assert_output_copies_dropped(manager, config.num_layers)
    assert_step_close(got, want, atol=3e-2, rtol=3e-2)


def test_recognises_the_online_softmax_form():
    """Inductor on CUDA rewrites softmax as prepare_softmax_online (seen on an H100, fp32 GQA
    math lowering); the math matcher must still find the logits."""
    import torch._inductor.compile_fx  # registers prims.prepare_softmax_online

    from specrun.runtime.passes.sdpa import _decomposed_softmax_input

    aten, prims = torch.ops.aten, torch.ops.prims
    graph = torch.fx.Graph()
    logits = graph.placeholder("logits")
    stats = graph.call_function(prims.prepare_softmax_online.default, (logits, -1))
    row_max = graph.call_function(operator.getitem, (stats, 0))
    total = graph.call_function(operator.getitem, (stats, 1))
    shifted = graph.call_function(aten.sub.Tensor, (logits, row_max))
    exp = graph.call_function(aten.exp.default, (shifted,))
    probs = graph.call_function(aten.div.Tensor, (exp, total))
    assert _decomposed_softmax_input(probs) is logits
    swapped = graph.call_function(aten.div.Tensor, (exp, row_max))
    assert _decomposed_softmax_input(swapped) is None
