"""specrun.runtime where Triton is missing (macOS, Windows, CPU-only installs): it imports, its
`rt::` ops exist and run their references, the passes still put them into CPU graphs, and
speculative decoding on the CPU reproduces the reference decoder token for token.

Triton is installed here, so each check runs this file as a script in a subprocess that makes
it unimportable first (`sys.modules["triton"] = None`, before torch is imported: `import
triton` then fails and `importlib.util.find_spec` reports it missing, as without the package).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from specrun.models.attention import chain_ancestors, pack_ancestor_mask
from specrun.models.attention import tree_attention as model_tree_attention
from specrun.runtime import Engine, EngineConfig, SamplingParams
from specrun.runtime.decoder import Decoder
from specrun.runtime.kernels.rejection import rejection_walk, rejection_walk_ref
from specrun.runtime.kernels.topk import log_softmax_topk, log_softmax_topk_ref, topk, topk_ref
from specrun.runtime.kernels.tree_attention import tree_attention, tree_attention_ref
from specrun.runtime.passes.topk import SmallTopkReplacement
from specrun.runtime.passes.tree_attention import TreeAttentionFusion
from specrun.runtime.reference import reference_generate
from specrun.runtime.stats import DecodeStats
from specrun.runtime.tree import TreeShape
from tiny_models import decode_tokens, random_head, random_llama, tiny_config

logger = logging.getLogger(__name__)

# Run in the subprocess before anything else: Triton unimportable, then this file's checks.
_WITHOUT_TRITON = (
    "import runpy, sys; sys.modules['triton'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [12], [40, 41, 42]]
EOS = (11,)


def _run_without_triton(check: str) -> None:
    """Run `check` (a name in CHECKS) in a subprocess where Triton cannot be imported."""
    tests = str(Path(__file__).parents[1])
    path = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON, __file__, check],
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_runtime_imports_runs_its_ops_and_decodes_without_triton():
    _run_without_triton("eager")


@pytest.mark.slow
def test_compiled_verify_fuses_tree_attention_without_triton():
    _run_without_triton("compiled")


def _check_triton_is_missing() -> None:
    from specrun.runtime.kernels import _triton

    assert importlib.util.find_spec("triton") is None
    with pytest.raises(ImportError):
        import triton  # noqa: F401
    assert not _triton.HAS_TRITON
    assert callable(Engine.from_pretrained)  # the public API loaded (imported at the top)


def _tree_attention_args(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """rt::tree_attention arguments: 2 slots, 4 query heads over 2 KV heads, 3 tree queries
    (a chain) over a 10-position cache filled to 4 and 6."""
    torch.manual_seed(0)
    anc = pack_ancestor_mask(torch.ones(3, 3, dtype=torch.bool).tril()).expand(2, -1, -1)
    kv = [torch.randn(2, 2, size, 8, dtype=dtype) for size in (10, 10, 3, 3)]
    q = torch.randn(2, 4, 3, 8, dtype=dtype)
    return q, kv[0], kv[1], torch.tensor([4, 6]), kv[2], kv[3], anc.contiguous()


def _rejection_walk_args() -> tuple[torch.Tensor, ...]:
    """rt::rejection_walk arguments: 2 rows, a 5-node tree (root -> 1, 2; 1 -> 3, 4) over a
    vocabulary of 12 of which the draft knows 7; nodes 3 and 4 drafted nothing."""
    torch.manual_seed(0)
    batch, vocab, draft_vocab = 2, 12, 7
    parent = torch.tensor([0, 0, 0, 1, 1]).expand(batch, -1).contiguous()
    node_row = torch.tensor([0, 1, -1, -1, -1]).expand(batch, -1).contiguous()
    return (
        torch.randn(batch, 5, vocab).softmax(-1),
        parent,
        node_row,
        torch.randint(0, draft_vocab, (batch, 5)),
        torch.randn(batch, 2, draft_vocab).softmax(-1),
        torch.randperm(vocab)[:draft_vocab],
        torch.rand(batch, 2, 2),
    )


def _check_ops_run_their_references() -> None:
    """On CPU tensors each op is its reference; opcheck covers its fake impl too."""
    args = _tree_attention_args(torch.float32)
    got = tree_attention(*args, scale=0.3)
    assert torch.equal(got, tree_attention_ref(*args, scale=0.3))
    want = model_tree_attention(*args, scale=0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.library.opcheck(torch.ops.rt.tree_attention.default, args, {"scale": 0.3})

    x = torch.randn(5, 300)
    for op, ref in ((topk, topk_ref), (log_softmax_topk, log_softmax_topk_ref)):
        for got, want in zip(op(x, 4), ref(x, 4), strict=True):
            assert torch.equal(got, want)
    assert torch.equal(topk(x, 4)[0], torch.topk(x, 4).values)
    for op in (torch.ops.rt.topk.default, torch.ops.rt.log_softmax_topk.default):
        torch.library.opcheck(op, (x, 4))

    args = _rejection_walk_args()
    for got, want in zip(rejection_walk(*args), rejection_walk_ref(*args), strict=True):
        assert torch.equal(got, want)
    torch.library.opcheck(torch.ops.rt.rejection_walk.default, args)
    logger.info("rt:: ops match their references")


def _check_passes_fuse_a_cpu_graph() -> None:
    """The passes replace the reference attention and a small topk in traced float64 / float32
    CPU graphs by rt:: ops, and the graphs still compute what eager does."""
    args = _tree_attention_args(torch.float64)

    def attention(*inputs):
        return model_tree_attention(*inputs, scale=0.3)

    decompositions = select_decomp_table()
    graph_module = make_fx(attention, decompositions, tracing_mode="fake")(*args)
    assert TreeAttentionFusion()(graph_module.graph) == 1
    graph_module.graph.eliminate_dead_code()
    graph_module.recompile()
    targets = {node.target for node in graph_module.graph.nodes if node.op == "call_function"}
    assert targets == {torch.ops.rt.tree_attention.default}
    torch.testing.assert_close(graph_module(*args), attention(*args), atol=1e-12, rtol=1e-12)

    x = torch.randn(6, 50)
    graph_module = make_fx(lambda rows: torch.topk(rows, 3), tracing_mode="fake")(x)
    assert SmallTopkReplacement()(graph_module.graph) == 1
    graph_module.recompile()
    for got, want in zip(graph_module(x), torch.topk(x, 3), strict=True):
        assert torch.equal(got, want)
    logger.info("passes fuse CPU graphs")


def _check_speculative_decoding_matches_the_reference() -> None:
    """Greedy speculative decoding of a tiny float64 target with a random EAGLE-3 head (a
    dynamic tree at bucket 1, a stochastic one at 2 and 4, run as its top-k tree for greedy
    batches) gives the reference decoder's tokens; a sampled batch walks the stochastic tree
    through rt::rejection_walk."""
    target = random_llama(tiny_config(), dtype=torch.float64)
    head = random_head("eagle3", target)
    trees = {1: TreeShape(4, 3, 10), 2: TreeShape(3, 2, 6, stochastic=True), 4: None}
    config = EngineConfig(device="cpu", buckets=(1, 2, 4), trees=trees, max_seq_len=64)
    decoder = Decoder(target, head, config, eos_token_ids=EOS)
    for prompts in (PROMPTS[:1], PROMPTS[1:3], PROMPTS):
        params = [SamplingParams(max_new_tokens=n) for n in (20, 9, 13, 5)][: len(prompts)]
        want = reference_generate(target, prompts, params, eos_token_ids=EOS)
        tokens, _ = decode_tokens(decoder, prompts, params)
        assert tokens == [w.token_ids for w in want], len(prompts)

    stats = DecodeStats()
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)
    tokens, _ = decode_tokens(decoder, PROMPTS[:2], sampled, stats=stats)
    assert [len(t) for t in tokens] == [12, 12] and stats.num_rounds > 0
    assert all(0 <= t < target.config.vocab_size for row in tokens for t in row)
    logger.info("speculative decoding matches the reference")


def _check_compiled_verify_fuses() -> None:
    """Inductor compiles a tree verify on the CPU with the fusion pass: each layer's attention
    becomes rt::tree_attention, which the compiled graph calls, equal to eager."""
    from specrun.runtime.graphs import compile_verify
    from specrun.runtime.kv_cache import KVCache
    from specrun.runtime.passes import PassManager

    target = random_llama(tiny_config(), dtype=torch.float64)
    cache = KVCache.allocate(
        target.config, batch_size=2, capacity=16, dtype=torch.float64, device="cpu"
    )
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths.copy_(torch.tensor([5, 9]))
    anc = chain_ancestors(2, 4, "cpu")
    tokens = torch.randint(0, target.config.vocab_size, (2, 4))
    inputs = (tokens, cache.lengths[:, None] + torch.arange(4), cache.attention_inputs(anc))
    manager = PassManager([TreeAttentionFusion()])
    with (  # fresh compiles: a cached graph would skip the passes
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        got = compile_verify(target, manager=manager)(*inputs)
    assert manager.stats["tree_attention"] == target.config.num_layers
    torch.testing.assert_close(got.hidden, target(*inputs).hidden, atol=1e-10, rtol=1e-10)
    logger.info("compiled verify fuses")


CHECKS = {
    "eager": (
        _check_ops_run_their_references,
        _check_passes_fuse_a_cpu_graph,
        _check_speculative_decoding_matches_the_reference,
    ),
    "compiled": (_check_compiled_verify_fuses,),
}


def _main(check: str) -> None:
    logging.basicConfig(level=logging.INFO)
    _check_triton_is_missing()
    with torch.no_grad():
        for run in CHECKS[check]:
            run()
    # Nothing reached Triton some other way (importlib, a cached submodule).
    assert sys.modules["triton"] is None
    assert not any(name.startswith("triton.") for name in sys.modules)


if __name__ == "__main__":
    _main(sys.argv[1])
