"""EAGLE draft heads: what they compute, in the same conventions as the Llama target.

Three kinds, one class each, all with the same call:
  head(tokens [B,T], features [B,T,H], positions [B,T], attn) -> DraftOutput
where `features` is the previous step's feature for each token: the target's contribution on
the first step (`head.target_features(target_out)`), the head's own `hidden` after that.

  Eagle1Head  EAGLE-1/2: x = fc([embed(tok), feature]); decoder layer(s), the first without
              input norm; logits = target lm_head(x), no final norm. Feature: the target's
              post-norm hidden state.
  Eagle3Head  EAGLE-3: feature = fc(three target taps) on the first step; a mid layer
              attending over [input_layernorm(embed(tok)), hidden_norm(feature)], then
              num_layers - 1 full decoder layers (none in published heads);
              logits = lm_head(norm(x)) over a draft vocabulary, mapped back by `d2t`.
  DenseHead   the multi-layer drafter of arXiv 2508.08192: x = fc([embed(tok), feature]);
              N full decoder layers; logits = lm_head(norm(x)) (own lm_head, or the target's
              when `DraftConfig.shared_lm_head`).

Sharing: every head embeds tokens with the TARGET's embed_tokens, except an EAGLE-3 head
whose hidden size differs from the target's, which owns an embedding. EAGLE-1 heads (and
dense heads with shared_lm_head) project with the target's lm_head. Borrowed modules are held
in `head.shared`, not registered: they are not in the head's parameters or state_dict (the
target owns, moves and saves them), so a checkpoint's `embed_tokens.weight` copy is dropped
on load (see loading.py).

Parameter names are the published checkpoint names (yuhuili EAGLE / EAGLE-3, SpecForge), so
checkpoints load without renaming. Attention goes through models.llama's Attention, i.e.
models/attention.py, over the head's own committed KV cache + side buffer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from .config import DraftConfig, LlamaConfig
from .llama import (
    MLP,
    Attention,
    AttentionInputs,
    DecoderLayer,
    Llama,
    ModelOutput,
    NewKeysValues,
    RMSNorm,
    RotaryEmbedding,
)

NUM_EAGLE3_TAPS = 3


@dataclass
class DraftOutput(NewKeysValues):
    """One draft forward over T new tokens.

    hidden: [B, T, H] the head's output hidden state (pre final norm): the next step's feature.
    logits: [B, T, V_draft] over the head's output vocabulary (`to_target_ids` maps ids back).
    k_tree, v_tree: [num_layers, B, Hkv, N0 + T, D] the tree keys/values the forward attended
        to: the side buffer's N0 (none without one), then the T new tokens'. The next tree
        level's side buffer as they are (no copy); `k_new` / `v_new` are the new tokens' alone.
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    k_tree: torch.Tensor
    v_tree: torch.Tensor


@dataclass(frozen=True)
class SharedModules:
    """Target modules a head borrows (unregistered: the target owns and saves them)."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


def run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    attn: AttentionInputs,
    *,
    first_layer: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Decoder layers in order, layer i attending to cache layer first_layer + i.
    x: [B, T, H]. Returns x and each layer's tree keys and values [B, Hkv, N0 + T, D]."""
    k_tree, v_tree = [], []
    for i, layer in enumerate(layers):
        x, k, v = layer(x, rope, attn, first_layer + i)
        k_tree.append(k)
        v_tree.append(v)
    return x, k_tree, v_tree


def stack_layers(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """[num_layers, ...] from each layer's tensor: a view for one layer (no copy of a
    one-layer head's tree keys), a stack for more."""
    return per_layer[0][None] if len(per_layer) == 1 else torch.stack(per_layer)


class DraftHead(nn.Module):
    """What every head shares: its config, borrowed target modules, rotary tables."""

    def __init__(self, config: DraftConfig, shared: SharedModules) -> None:
        super().__init__()
        self.config = config
        self.shared = shared
        self.rotary = RotaryEmbedding(config.layer)

    @property
    def uses_taps(self) -> bool:
        """Whether the first-step features come from the target's taps (EAGLE-3)."""
        return False

    @property
    def num_layers(self) -> int:
        """Attention layers, i.e. the leading dimension of the head's KV cache."""
        return self.config.num_layers

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute non-persistent buffers after meta-device construction."""
        self.rotary.init_buffers(device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] int64 target ids. Returns [B, T, H_embed]."""
        return self.shared.embed_tokens(tokens)

    def target_features(self, target_out: ModelOutput) -> torch.Tensor:
        """First-step features [B, T, H] from a target forward: its post-norm hidden state."""
        return target_out.hidden

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """draft_ids: int64 ids in the head's output vocabulary. Returns target ids, same shape."""
        return draft_ids

    def trunk(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionInputs,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head's layers over T new tokens, without the logits: hidden [B, T, H] and the
        tree keys/values [num_layers, B, Hkv, N0 + T, D] (see DraftOutput)."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] the trunk's output. Returns [..., V_draft]."""
        raise NotImplementedError

    def forward(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionInputs,
    ) -> DraftOutput:
        """tokens, positions: [B, T] int64; features: [B, T, H]. attn: the draft's cache.
        The trunk, then the logits at every new token."""
        hidden, k_tree, v_tree = self.trunk(tokens, features, positions, attn)
        return DraftOutput(hidden, self.logits(hidden), k_tree, v_tree)


class FusedInputHead(DraftHead):
    """Heads whose input is fc([embed(token), feature]) followed by decoder layers."""

    def trunk(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionInputs,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, positions: [B, T] int64; features: [B, T, H]. attn: the draft's cache.
        Returns hidden [B, T, H] and the tree keys/values [num_layers, B, Hkv, N0 + T, D]."""
        x = self.fc(torch.cat([self.embed(tokens), features], dim=-1))
        rope = self.rotary(positions, x.dtype)
        x, k_tree, v_tree = run_layers(self.layers, x, rope, attn.with_shared_mask())
        return x, stack_layers(k_tree), stack_layers(v_tree)


class Eagle1Head(FusedInputHead):
    """EAGLE-1/2 head (yuhuili `cnets1.py` layout: `fc`, `layers.{i}`, no input norm on 0)."""

    def __init__(self, config: DraftConfig, shared: SharedModules) -> None:
        super().__init__(config, shared)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(
            DecoderLayer(config.layer, input_norm=i > 0) for i in range(config.num_layers)
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H]. The target's lm_head, no final norm (EAGLE-1 regresses the
        target's post-norm feature)."""
        return self.shared.lm_head(hidden)


class DenseHead(FusedInputHead):
    """N-layer dense drafter: `fc`, `layers.{i}` (full decoder layers), `norm`, `lm_head`."""

    def __init__(self, config: DraftConfig, shared: SharedModules) -> None:
        super().__init__(config, shared)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config.layer) for _ in range(config.num_layers))
        self.norm = RMSNorm(hidden, config.layer.rms_norm_eps)
        if not config.shared_lm_head:
            self.lm_head = nn.Linear(hidden, config.vocab_out, bias=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] pre-norm. Returns [..., vocab]."""
        lm_head = self.shared.lm_head if self.config.shared_lm_head else self.lm_head
        return lm_head(self.norm(hidden))


class Eagle3MidLayer(nn.Module):
    """EAGLE-3 decoder layer: attention reads [norm(embedding), norm(feature)] (2H wide)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Attention(config, in_features=2 * hidden)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionInputs,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """embeds, features: [B, T, H]. Returns x [B, T, H] and the tree keys and values
        [B, Hkv, N0 + T, D] (`Attention.forward`)."""
        mixed = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        h, k, v = self.self_attn(mixed, rope, attn, layer)
        x = features + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class Eagle3Head(DraftHead):
    """EAGLE-3 head (yuhuili / SpecForge layout: `fc`, `midlayer`, `norm`, `lm_head`,
    buffers `d2t` [draft_vocab] int64 and `t2d` [vocab] bool).

    With `config.num_layers` = N > 1, N - 1 full decoder layers `layers.{i}` (i = 0..N-2)
    follow the mid layer, layer i attending to draft cache layer i + 1 (the mid layer is
    cache layer 0). `layers.{i}` is this project's extension of the SpecForge layout, whose
    heads have the mid layer only; a one-layer head holds no `layers.*` and computes exactly
    the published head.
    """

    def __init__(self, config: DraftConfig, shared: SharedModules) -> None:
        super().__init__(config, shared)
        hidden = config.hidden_size
        self.fc = nn.Linear(NUM_EAGLE3_TAPS * config.feature_size, hidden, bias=config.fc_bias)
        self.midlayer = Eagle3MidLayer(config.layer)
        # Empty for one layer: no parameters, so no state-dict names either.
        self.layers = nn.ModuleList(
            DecoderLayer(config.layer) for _ in range(config.num_layers - 1)
        )
        self.norm = RMSNorm(hidden, config.layer.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.vocab_out, bias=False)
        # target_id = draft_id + d2t[draft_id]; t2d[target_id] marks the draft vocabulary.
        # Until trained or loaded: the first draft_vocab target ids.
        self.register_buffer("d2t", torch.zeros(config.vocab_out, dtype=torch.int64))
        vocab_ids = torch.arange(config.layer.vocab_size)
        self.register_buffer("t2d", vocab_ids < config.vocab_out)
        if shared.embed_tokens.embedding_dim != hidden:
            self.embed_tokens = nn.Embedding(config.layer.vocab_size, hidden)

    @property
    def uses_taps(self) -> bool:
        return True

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] int64 target ids. Returns [B, T, H]."""
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens(tokens)
        return self.shared.embed_tokens(tokens)

    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """taps: [B, T, num_taps * target_H] (Llama ModelOutput.taps). Returns [B, T, H]."""
        return self.fc(taps)

    def target_features(self, target_out: ModelOutput) -> torch.Tensor:
        """First-step features [B, T, H]: the projected target taps."""
        return self.project(target_out.taps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] pre-norm. Returns [..., draft_vocab]."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """draft_ids: int64 in [0, draft_vocab). Returns the target ids, same shape, int64."""
        return draft_ids + self.d2t[draft_ids]

    def trunk(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionInputs,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, positions: [B, T] int64; features: [B, T, H], already projected (a
        `project(taps)` result or a previous `hidden`). attn: the draft's cache
        (num_layers layers, the mid layer's first). Returns hidden [B, T, H] and the tree
        keys/values [num_layers, B, Hkv, N0 + T, D] (the side buffer's, then the new
        tokens')."""
        rope = self.rotary(positions, features.dtype)
        attn = attn.with_shared_mask()
        x, k, v = self.midlayer(self.embed(tokens), features, rope, attn, 0)
        x, k_tree, v_tree = run_layers(self.layers, x, rope, attn, first_layer=1)
        return x, stack_layers([k, *k_tree]), stack_layers([v, *v_tree])


_HEAD_OF_KIND: dict[str, type[DraftHead]] = {
    "eagle1": Eagle1Head,
    "eagle3": Eagle3Head,
    "dense": DenseHead,
}


def check_compatible(config: DraftConfig, target: Llama) -> None:
    """Raise ValueError naming every way `config` cannot run on `target`."""
    problems = _size_problems(config, target)
    if problems:
        # A head sized for another model cannot be adapted: no tap choice fixes a width.
        problems.append("use a head trained for this target")
    elif config.kind == "eagle3":
        problems = _tap_problems(config, target)
    if problems:
        raise ValueError("draft head does not fit the target: " + "; ".join(problems))


def _size_problems(config: DraftConfig, target: Llama) -> list[str]:
    target_cfg = target.config
    problems = []
    if config.layer.vocab_size != target_cfg.vocab_size:
        problems.append(
            f"it was trained for vocab_size {config.layer.vocab_size}, "
            f"the target's vocab_size is {target_cfg.vocab_size}"
        )
    if config.feature_size != target_cfg.hidden_size:
        source = " (its target_hidden_size)" if config.target_hidden_size else ""
        problems.append(
            f"it was trained on a target with hidden_size {config.feature_size}{source}, "
            f"this target's hidden_size is {target_cfg.hidden_size}"
        )
    elif config.kind != "eagle3" and config.hidden_size != target_cfg.hidden_size:
        problems.append(
            f"{config.kind} heads share the target's embedding, so their hidden_size "
            f"({config.hidden_size}) must equal the target's ({target_cfg.hidden_size})"
        )
    return problems


def _tap_problems(config: DraftConfig, target: Llama) -> list[str]:
    head_taps = config.tap_layers
    if head_taps is not None and len(head_taps) != NUM_EAGLE3_TAPS:
        return [
            f"EAGLE-3 heads read {NUM_EAGLE3_TAPS} target taps, it lists {len(head_taps)} "
            f"(tap_layers={head_taps}, eagle_aux_hidden_state_layer_ids in config.json)"
        ]
    depth = target.config.num_layers
    too_deep = [t for t in head_taps or () if t > depth]
    if too_deep:
        layer_outputs = [t - 1 for t in too_deep]
        return [
            f"it taps layer(s) {too_deep} (eagle_aux_hidden_state_layer_ids {layer_outputs}) "
            f"but the target has {depth} layers (taps 0..{depth}, tap i being the input of "
            "layer i); it was trained for a deeper model: use a head trained for this target"
        ]
    fix = f"load the target with tap_layers={head_taps or None}"
    if len(target.tap_layers) != NUM_EAGLE3_TAPS:
        taps = target.tap_layers
        return [
            f"EAGLE-3 needs {NUM_EAGLE3_TAPS} target taps, the target has tap_layers={taps}; {fix}"
        ]
    if head_taps is not None and tuple(head_taps) != tuple(target.tap_layers):
        return [
            f"the head was trained on taps {head_taps}, the target produces "
            f"{target.tap_layers}; {fix}"
        ]
    return []


def add_layers(head: DraftHead, *, num_layers: int) -> DraftHead:
    """A copy of `head` (same kind, device and dtype) with fresh decoder layers appended
    after its last one up to `num_layers` attention layers, sharing its borrowed modules.

    Its own tensors are copied; the new layers are initialised from the current RNG, then
    their `o_proj` and `down_proj` zeroed: each adds nothing to the residual stream, so the
    deeper head computes the same hidden state and logits as `head` until trained.
    """
    if not isinstance(head, (FusedInputHead, Eagle3Head)):
        raise TypeError(f"cannot add layers to a {type(head).__name__}")
    if num_layers < head.num_layers:
        raise ValueError(f"the head has {head.num_layers} layers, num_layers={num_layers} fewer")
    config = dataclasses.replace(head.config, num_layers=num_layers)
    with torch.device(head.fc.weight.device):
        deeper = type(head)(config, head.shared).to(head.fc.weight.dtype)
    deeper.load_state_dict(head.state_dict(), strict=False)  # missing: the new layers only
    with torch.no_grad():
        for layer in deeper.layers[len(head.layers) :]:
            for out_proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                out_proj.weight.zero_()
                if out_proj.bias is not None:
                    out_proj.bias.zero_()
    return deeper.train(head.training)


def with_draft_vocab(head: Eagle3Head, kept: torch.Tensor, *, new_rows: torch.Tensor) -> Eagle3Head:
    """A copy of the EAGLE-3 `head` drafting over the target ids `kept` instead of its own
    vocabulary (same layers, device and dtype; its borrowed modules shared).

    Args:
        kept: [V'] int64 target ids, ascending: the new draft vocabulary.
        new_rows: [V', H] lm_head rows, row i for `kept[i]`, used for the ids the head does
            not draft yet; the ids it drafts keep their trained rows, so the copy's logits
            over them equal the head's.
    """
    if not isinstance(head, Eagle3Head):
        raise TypeError(f"only EAGLE-3 heads have a draft vocabulary, not a {type(head).__name__}")
    weight = head.lm_head.weight
    kept = kept.to(weight.device)
    config = dataclasses.replace(head.config, draft_vocab_size=kept.numel())
    with torch.device(weight.device):
        copy = Eagle3Head(config, head.shared).to(weight.dtype)
    own = ("lm_head.", "d2t", "t2d")
    state = {name: t for name, t in head.state_dict().items() if not name.startswith(own)}
    copy.load_state_dict(state, strict=False)
    with torch.no_grad():
        copy.d2t.copy_(kept - torch.arange(kept.numel(), device=kept.device))
        copy.t2d.zero_()
        copy.t2d[kept] = True
        old_ids = torch.arange(weight.shape[0], device=weight.device)
        draft_id_of = torch.full_like(head.t2d, -1, dtype=torch.int64)
        draft_id_of[head.to_target_ids(old_ids)] = old_ids
        rows = new_rows.to(weight, copy=True)
        drafted = head.t2d[kept]
        rows[drafted] = weight[draft_id_of[kept[drafted]]]
        copy.lm_head.weight.copy_(rows)
    return copy.train(head.training)


def build_draft(config: DraftConfig, target: Llama) -> DraftHead:
    """The head `config` describes, wired to `target`'s embedding (and lm_head where shared).

    Parameters are created on the current default device (use `torch.device("meta")` to
    build without allocating, as loading.py does); the target's modules are borrowed as is.
    """
    check_compatible(config, target)
    shared = SharedModules(target.embed_tokens, target.lm_head)
    return _HEAD_OF_KIND[config.kind](config, shared)
