"""GPU tier on a machine with two GPUs: a tensor-parallel engine (NCCL; eager, then
compiled rounds, with their collectives captured in each rank's CUDA graphs) decodes what
reference greedy decoding of the unsharded target decodes, bf16, up to divergences at
near-ties of the target's top two logits (the ranks add the partial sums of the row-parallel
projections in another order); after warm-up its rounds, whichever shape the policy picks,
need no recompile and no host sync on rank 0. (The reference rather than a single-GPU
engine: compiling a second engine's ladders would double the test's minutes.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from specrun.models.loading import save_draft, save_target
from specrun.runtime import Engine, EngineConfig, SamplingParams
from specrun.runtime.reference import reference_generate
from specrun.runtime.tree import TreeShape
from tiny_models import prompt_logits, random_head, random_llama, tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

# bf16 logits carry about 3 significant digits: a gap below this is a tie to the model.
NEAR_TIE = 0.05
CONFIG = EngineConfig(
    device="cuda",
    dtype="bfloat16",
    buckets=(1, 4),
    trees={1: TreeShape(4, 4, 16), 4: TreeShape(2, 2, 4)},
    max_seq_len=256,
    policy="cost",
    tensor_parallel=2,
)
PROMPT_LENGTHS = (5, 17, 33, 64, 9, 40)
PARAMS = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A bf16 target whose heads, KV heads, MLP width and vocabulary divide by 2, with a
    random EAGLE-3 head: (model dir, head dir, the target on cuda:0 for the tie check)."""
    out = tmp_path_factory.mktemp("gpu-tensor-parallel")
    config = tiny_config(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
    )
    target = random_llama(config, seed=3, dtype=torch.bfloat16)
    model_dir = save_target(target, out / "model")
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    head_dir = save_draft(random_head("eagle3", target, seed=4), out / "head")
    return model_dir, head_dir, target.cuda()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _decode(model_dir, head_dir, config: EngineConfig) -> tuple[list[list[int]], dict, dict]:
    """Greedy tokens of the prompts, and each compiled step's compile count before and after
    the requests (the requests running with CUDA sync debugging set to error on rank 0)."""
    with Engine.from_pretrained(model_dir, draft=head_dir, config=config) as engine:
        # The prompts' prefill graphs too: compiling one later would sync inside the requests.
        engine.warmup(progress=False, prompt_lengths=PROMPT_LENGTHS)
        before = {name: s.num_compiles for name, s in engine.decoder.compiled_steps().items()}
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs = engine.generate(_prompts(), PARAMS)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        after = {name: s.num_compiles for name, s in engine.decoder.compiled_steps().items()}
    return [out.token_ids for out in outputs], before, after


# Eager rounds in CUDA graphs first: minutes cheaper than compiled ones, and whether NCCL
# inside captured graphs works at all is known before compilation comes in.
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-graphs", "compiled"])
def test_two_gpus_decode_what_reference_decoding_decodes(model_dirs, compiled):
    model_dir, head_dir, target = model_dirs
    with torch.no_grad():
        want = [w.token_ids for w in reference_generate(target, _prompts(), PARAMS)]
    config = dataclasses.replace(CONFIG, compile=compiled)
    got, before, after = _decode(model_dir, head_dir, config)
    assert after == before, "a round recompiled after warm-up"
    divergences = []
    with torch.no_grad():
        for prompt, w, g in zip(_prompts(), want, got, strict=True):
            if w == g:
                continue
            i = next(i for i, (a, b) in enumerate(zip(w, g, strict=False)) if a != b)
            top = prompt_logits(target, prompt + w[:i])[-1].float().topk(2).values
            divergences.append((i, float(top[0] - top[1])))
    print(f"TP=2 against the reference: divergences (position, top-2 logit gap): {divergences}")
    assert all(gap < NEAR_TIE for _, gap in divergences), divergences
