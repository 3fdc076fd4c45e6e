"""The Llama target model: what it computes, nothing about speed.

One forward over new tokens at given positions, attending to a committed static KV cache plus
the new tokens' own keys under an ancestor bitmask (a chain for prompts, a tree for
verification). Returns the post-norm hidden state (the EAGLE-1 feature), the hidden states
entering the EAGLE-3 tap layers and the new tokens' K/V, which the caller commits to the cache
or keeps in a side buffer. State-dict names follow transformers' LlamaForCausalLM (minus the
`model.` prefix), so HF checkpoints load without a key map: q/k/v and gate/up run as one GEMM
each (FusedLinear) but are stored as the separate projections.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import host_attention_mask, tree_attention
from .config import LlamaConfig
from .fused_linear import FusedLinear, store_parts_separately


def rope_inv_freq(config: LlamaConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2] float32, scaled as transformers does."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    rope = config.rope_scaling
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_context = rope.original_max_position_embeddings
        low_freq_wavelen = old_context / rope.low_freq_factor
        high_freq_wavelen = old_context / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_context / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for integer positions, computed on the fly (no max-length table)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        column_freq, sin_sign = _rope_columns(config)
        self.register_buffer("column_freq", column_freq, persistent=False)
        self.register_buffer("sin_sign", sin_sign, persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the non-persistent buffers after meta-device construction."""
        self.column_freq, self.sin_sign = _rope_columns(self.config, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions: [B, T] int64. Returns cos and the signed sin (see apply_rope):
        [B, 1, T, head_dim] in `dtype`."""
        # One frequency per column, not two concatenated halves: a rotation inlined into a
        # copy computes one sin and one cos an element instead of two of each and a select
        # (the same values: the sign multiplies exactly).
        freqs = (positions[..., None].float() * self.column_freq)[:, None]
        return freqs.cos().to(dtype), (freqs.sin() * self.sin_sign).to(dtype)


def _rope_columns(
    config: LlamaConfig, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of a head: its inverse frequency and the sign of its sin term, each
    [head_dim] float32 (the rotate-half convention: column d pairs with d +- head_dim / 2)."""
    inv_freq = rope_inv_freq(config, device)
    half = inv_freq.shape[0]
    sign = torch.ones(2 * half, device=device)
    sign[:half] = -1.0
    return torch.cat([inv_freq, inv_freq]), sign


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos, signed_sin: [B, 1, T, D] from RotaryEmbedding. The rotate-half
    convention of HF, x * cos + cat([-x2, x1]) * sin, with the sign moved onto sin (exact: a
    negation rounds nothing) so that the rotation is one roll."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim]. Normalised in float32 for half-precision inputs (rms_norm's
        accumulation type) and rounded to x's dtype before the weight multiplies it, as HF
        does."""
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


@dataclass
class AttentionInputs:
    """What one forward attends to besides its own tokens.

    k_cache, v_cache: [L, B, Hkv, S, D] committed caches (one slice per layer).
    cache_len: [B] int64, committed length per slot.
    anc: [B, T, W] int64 ancestor bitmask over the tree keys (side buffer, then new tokens).
    k_side, v_side: optional [L, B, Hkv, N0, D] tree nodes of earlier steps of this round.
    mask: optional [B, 1, T, S' + N0 + T] bool, every layer's mask (`with_shared_mask`).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_len: torch.Tensor
    anc: torch.Tensor
    k_side: torch.Tensor | None = None
    v_side: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def with_shared_mask(self) -> AttentionInputs:
        """These inputs with the mask built once for all layers where a forward runs eagerly
        on the CPU (models/attention.py: host_attention_mask); elsewhere unchanged."""
        num_side = 0 if self.k_side is None else self.k_side.shape[3]
        num_tree_keys = num_side + self.anc.shape[1]
        mask = host_attention_mask(self.cache_len, self.anc, num_tree_keys=num_tree_keys)
        return self if mask is None else dataclasses.replace(self, mask=mask)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, *, in_features: int | None = None) -> None:
        super().__init__()
        in_features = in_features or config.hidden_size
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.qkv_proj = FusedLinear(
            in_features, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, bias=bias
        )
        store_parts_separately(self)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionInputs,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, in]. Returns output [B, T, H] and the tree keys and values it attended
        to, [B, Hkv, N0 + T, D]: attn's side buffer (N0 = 0 without one), then this step's."""
        B, T, _ = x.shape
        num_rotated = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj.joint(x).view(B, T, num_rotated + self.num_kv_heads, self.head_dim)
        qkv = qkv.transpose(1, 2)
        # q and k rotate apart: one rotation feeding both copies made Inductor store a partial
        # rotation between two kernels in every layer of a tree forward. Contiguous copies:
        # concatenating strided slices with the cache at B > 1 took a slower copy kernel.
        q = apply_rope(qkv[:, : self.num_heads], *rope).contiguous()
        k = apply_rope(qkv[:, self.num_heads : num_rotated], *rope).contiguous()
        v = qkv[:, num_rotated:].contiguous()
        k_tree, v_tree = k, v
        if attn.k_side is not None:
            k_tree = torch.cat([attn.k_side[layer], k], dim=2)
            v_tree = torch.cat([attn.v_side[layer], v], dim=2)
        out = tree_attention(
            q,
            attn.k_cache[layer],
            attn.v_cache[layer],
            attn.cache_len,
            k_tree,
            v_tree,
            attn.anc,
            scale=self.head_dim**-0.5,
            mask=attn.mask,
        )
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out), k_tree, v_tree


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        dim, hidden, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = FusedLinear(dim, {"gate_proj": hidden, "up_proj": hidden}, bias=bias)
        store_parts_separately(self)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP. EAGLE-1 heads drop the input norm."""

    def __init__(self, config: LlamaConfig, *, input_norm: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        if input_norm:
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionInputs,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, T, H]. Returns x and the tree keys and values, [B, Hkv, N0 + T, D]
        (`Attention.forward`)."""
        normed = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        h, k, v = self.self_attn(normed, rope, attn, layer)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class NewKeysValues:
    """The new tokens' part of a forward's tree keys/values: `k_tree` / `v_tree` [L, B, Hkv,
    N0 + T, D] and `hidden` [B, T, ...] of the dataclass that mixes this in."""

    hidden: torch.Tensor
    k_tree: torch.Tensor
    v_tree: torch.Tensor

    @property
    def k_new(self) -> torch.Tensor:
        """[L, B, Hkv, T, D] keys of the T new tokens (a view of k_tree)."""
        return self.k_tree[:, :, :, -self.hidden.shape[1] :]

    @property
    def v_new(self) -> torch.Tensor:
        """[L, B, Hkv, T, D] values of the T new tokens (a view of v_tree)."""
        return self.v_tree[:, :, :, -self.hidden.shape[1] :]


@dataclass
class ModelOutput(NewKeysValues):
    """hidden: [B, T, H] post-norm; taps: [B, T, num_taps * H] or None;
    k_tree, v_tree: [L, B, Hkv, N0 + T, D] the tree keys/values the forward attended to: the
    side buffer's N0 (none without one), then the T new tokens' (`k_new`, `v_new`)."""

    hidden: torch.Tensor
    taps: torch.Tensor | None
    k_tree: torch.Tensor
    v_tree: torch.Tensor


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig, *, tap_layers: Sequence[int] | None = None) -> None:
        super().__init__()
        self.config = config
        taps = config.default_tap_layers if tap_layers is None else tuple(tap_layers)
        bad = [t for t in taps if not 0 <= t <= config.num_layers]
        if bad:
            raise ValueError(
                f"tap layers {bad} are outside [0, num_layers={config.num_layers}]; a tap i is "
                "the hidden state entering layer i (i = num_layers: the last layer's output)"
            )
        self.tap_layers = taps
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs
    ) -> ModelOutput:
        """tokens, positions: [B, T] int64. See AttentionInputs for the rest."""
        x = self.embed_tokens(tokens)
        rope = self.rotary(positions, x.dtype)
        attn = attn.with_shared_mask()
        entering: dict[int, torch.Tensor] = {}
        k_tree, v_tree = [], []
        for i, layer in enumerate(self.layers):
            if i in self.tap_layers:
                entering[i] = x
            x, k, v = layer(x, rope, attn, i)
            k_tree.append(k)
            v_tree.append(v)
        entering[len(self.layers)] = x
        taps = torch.cat([entering[t] for t in self.tap_layers], -1) if self.tap_layers else None
        return ModelOutput(self.norm(x), taps, torch.stack(k_tree), torch.stack(v_tree))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] post-norm. Returns [..., vocab] in the model dtype."""
        return self.lm_head(hidden)
