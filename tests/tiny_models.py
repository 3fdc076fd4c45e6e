"""Test helpers: tiny random Llama configs and models (importable as `tiny_models`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from specrun.models.config import LlamaConfig
from specrun.models.llama import Llama
from specrun.runtime.policies import Policy


def tiny_config(**overrides) -> LlamaConfig:
    fields = {
        "vocab_size": 97,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
    }
    return LlamaConfig(**(fields | overrides))


def random_llama(
    config: LlamaConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Llama:
    """A Llama with random weights large enough that greedy outputs are not degenerate."""
    torch.manual_seed(seed)
    model = Llama(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5 if param.dim() > 1 else 0.1)
        model.embed_tokens.weight.normal_(0.0, 1.0)
    return model.to(dtype).eval()


def random_head(kind: str, target: Llama, *, seed: int = 0, num_layers: int = 1):
    """A draft head of `kind` ("eagle1", "eagle3", "dense") with random weights for `target`
    and `num_layers` attention layers (an EAGLE-3 head's mid layer counting as one).

    EAGLE-3 heads get a draft vocabulary of about half the target's, mapped through a random
    d2t so that draft ids and target ids differ.
    """
    from specrun.models.config import DraftConfig
    from specrun.models.eagle import build_draft

    torch.manual_seed(seed)
    vocab = target.config.vocab_size
    draft_vocab = max(8, vocab // 2) if kind == "eagle3" else None
    config = DraftConfig(
        kind=kind,
        layer=target.config,
        num_layers=num_layers,
        draft_vocab_size=draft_vocab,
    )
    head = build_draft(config, target)
    if kind == "eagle3":
        kept = torch.randperm(vocab)[:draft_vocab].sort().values
        head.d2t.copy_(kept - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[kept] = True
    dtype = target.lm_head.weight.dtype
    return head.to(dtype).eval()


class TargetAsDraft(torch.nn.Module):
    """A near-perfect draft: the target itself, so proposals are the target's own choices.

    Draft position j holds token j+1; RoPE attention depends only on relative positions, so
    running the target there gives its next-token logits, except that the draft never sees the
    first prompt token (EAGLE heads get it through the features, which this one ignores).
    """

    def __init__(self, target: Llama) -> None:
        from specrun.models.config import DraftConfig

        super().__init__()
        self.target = target
        self.config = DraftConfig(
            kind="dense", layer=target.config, num_layers=target.config.num_layers
        )
        self.num_layers = target.config.num_layers

    def target_features(self, target_out):
        return target_out.hidden

    def to_target_ids(self, draft_ids):
        return draft_ids

    def trunk(self, tokens, features, positions, attn):
        out = self.target(tokens, positions, attn)
        return out.hidden, out.k_tree, out.v_tree

    def logits(self, hidden):
        return self.target.logits(hidden)

    def forward(self, tokens, features, positions, attn):
        from specrun.models.eagle import DraftOutput

        hidden, k_tree, v_tree = self.trunk(tokens, features, positions, attn)
        return DraftOutput(hidden, self.logits(hidden), k_tree, v_tree)


class ShuffledPolicy(Policy):
    """A speculation policy (runtime/policies/) that picks any candidate at random, so the
    shape changes between rounds, with probability `leave_behind` lets a plain round leave
    the drafts behind for good, and with probability `undrafted` has new requests prefilled
    without the head; remembers each round's tree and accepted drafts, and each admission's
    choice (`drafted`)."""

    name = "shuffled"

    def __init__(self, seed: int, *, leave_behind: float = 0.0, undrafted: float = 0.0) -> None:
        import random

        self._random = random.Random(seed)
        self._leave_behind = leave_behind
        self._left_behind = False
        self._undrafted = undrafted
        self.skips_drafts = undrafted > 0
        self.observed: list[tuple[object, list[int]]] = []
        self.drafted: list[bool] = []

    def drafts_new(self, bucket, candidates, requests, costs):
        self.drafted.append(self._random.random() >= self._undrafted)
        return self.drafted[-1]

    def choose(self, bucket, candidates, requests, costs):
        chosen = self._random.choice(candidates)
        self._left_behind = chosen.tree is None and self._random.random() < self._leave_behind
        return chosen

    def leaves_draft_behind(self, bucket):
        return self._left_behind

    def observe(self, bucket, candidate, accepted):
        self.observed.append((candidate.tree, list(accepted)))


def targets_with_heads() -> dict[str, tuple[Llama, torch.nn.Module | None]]:
    """One float64 tiny target without a head ("plain"), drafting for itself ("perfect": every
    draft is accepted) and with a random EAGLE-3 head ("eagle3")."""
    target = random_llama(tiny_config(), dtype=torch.float64)
    return {
        "plain": (target, None),
        "perfect": (target, TargetAsDraft(target)),
        "eagle3": (target, random_head("eagle3", target)),
    }


def prompt_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of one prompt run from an empty cache, on the model's device/dtype."""
    from specrun.models.attention import chain_ancestors
    from specrun.models.llama import AttentionInputs

    config, weight = model.config, model.lm_head.weight
    tokens = torch.tensor([ids], device=weight.device)
    length = tokens.shape[1]
    shape = (config.num_layers, 1, config.num_kv_heads, 1, config.head_dim)
    empty = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
    attn = AttentionInputs(
        empty,
        empty,
        torch.zeros(1, dtype=torch.int64, device=weight.device),
        chain_ancestors(1, length, weight.device),
    )
    positions = torch.arange(length, device=weight.device)[None]
    with torch.no_grad():
        return model.logits(model(tokens, positions, attn).hidden)[0]


def prefilled_state(target, head, shape, prompts, params, *, eos_token_ids=(11,)):
    """A SpecState for `prompts` (token-id lists), allocated just large enough and prefilled.
    Returns (state, prefill report)."""
    from specrun.runtime.prefill import allocate_state, prefill, state_capacity
    from specrun.runtime.requests import check_requests

    prompts, params = check_requests(prompts, params, vocab_size=target.config.vocab_size)
    depth = 0 if shape is None else shape.depth
    capacity = max(
        state_capacity(len(p), q.max_new_tokens, depth)
        for p, q in zip(prompts, params, strict=True)
    )
    state = allocate_state(target, head, batch_size=len(prompts), capacity=capacity, depth=depth)
    report = prefill(target, head, state, prompts, params, eos_token_ids)
    return state, report


def decode_tokens(decoder, prompts, params, *, stats=None):
    """Run `decoder.stream` to the end: (tokens per prompt, last finish reason per prompt)."""
    outputs, reasons = [[] for _ in prompts], [None] * len(prompts)
    for step in decoder.stream(prompts, params, stats=stats):
        for slot, (tokens, reason) in enumerate(step):
            outputs[slot].extend(tokens)
            reasons[slot] = reason or reasons[slot]
    return outputs, reasons


def save_byte_level_chat_model(out_dir: Path, chat_config_dir: Path) -> tuple[Path, Path]:
    """A tiny random Llama over a byte-level vocabulary (3 special tokens + the 256 bytes, so
    any text encodes and random output exercises multi-byte decoding) with a random EAGLE-3
    head, saved as HF directories: (model dir, head dir). Its tokenizer_config.json and
    generation_config.json (special tokens, chat template, EOS) are those of
    `chat_config_dir`, whose special tokens it must use: <|endoftext|>, <|im_start|>,
    <|im_end|> as ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from specrun.models.loading import save_draft, save_target

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + pre_tokenizers.ByteLevel.alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    config = tiny_config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_heads=4,
        head_dim=16, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
    )  # fmt: skip
    target = random_llama(config)
    model_dir = save_target(target, out_dir / "model")
    tokenizer.save(str(model_dir / "tokenizer.json"))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(chat_config_dir / name, model_dir / name)
    return model_dir, save_draft(random_head("eagle3", target, seed=1), out_dir / "head")


def chained_step_inputs(config, *, batch, num_tokens, dtype, device="cpu"):
    """Arguments of a target forward of `num_tokens` chained tokens per slot over random
    committed caches: (tokens, positions, attention inputs)."""
    from specrun.runtime.kv_cache import KVCache

    cache = KVCache.allocate(
        config, batch_size=batch, capacity=32, dtype=dtype, device=device, num_layers=None
    )
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths.copy_(torch.arange(batch, device=device) + 3)
    visible = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    bits = (visible.long() << torch.arange(num_tokens)).sum(-1, keepdim=True)
    anc = bits.expand(batch, -1, -1).to(device)
    tokens = torch.randint(0, config.vocab_size, (batch, num_tokens), device=device)
    positions = cache.lengths[:, None] + torch.arange(num_tokens, device=device)
    return tokens, positions, cache.attention_inputs(anc)


def assert_step_close(got, want, **tolerance):
    """A compiled target forward's outputs (hidden and the new tokens' keys and values) equal
    eager's within `tolerance` (torch.testing.assert_close's)."""
    for name in ("hidden", "k_new", "v_new"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), **tolerance)
