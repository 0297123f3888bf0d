"""Rotary position embeddings: the frequency of each channel pair, the cos/sin table over
positions, and the rotation itself. Shared by every attention variant."""

from __future__ import annotations

import math

import torch

from phalanx.model.config import ModelConfig


def rotary_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Angle per position step of each channel pair (rope_dim // 2,), with Llama 3.1's scaling:
    wavelengths longer than the original context are stretched by `rope_factor`, shorter than
    original / high_freq_factor kept, and the band between blended smoothly; or YaRN's."""
    head_dim = cfg.rope_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if cfg.rope_type == "yarn":
        return yarn_frequencies(cfg, inv_freq)
    if cfg.rope_type != "llama3":
        return inv_freq
    original = cfg.rope_original_max_seq_len
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / cfg.rope_low_freq_factor, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (original / wavelength - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    blended = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelength >= original / cfg.rope_high_freq_factor) & (wavelength <= original / cfg.rope_low_freq_factor)
    return torch.where(medium, blended, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-scale correction 0.1 m ln(s) + 1 for a context stretched s times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): channel pairs that turn more than beta_fast times over the
    original context keep their frequency (extrapolated), those turning fewer than beta_slow
    times are divided by rope_factor (interpolated), with a linear ramp between, as
    `transformers`' `_compute_yarn_parameters` computes it."""
    dim, base, original = cfg.rope_dim, cfg.rope_theta, cfg.rope_original_max_seq_len

    def channel(rotations: float) -> float:  # the channel pair that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = channel(cfg.rope_beta_fast), channel(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-channel band: avoid dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate (divide by the factor)
    return inv_freq / cfg.rope_factor * (1 - keep) + inv_freq * keep


def rotary_scale(cfg: ModelConfig) -> float:
    """How much the rotated channels are scaled (YaRN's attention factor; 1 otherwise)."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """The attention logits' scale: 1/sqrt(head_dim), times YaRN's mscale(factor,
    mscale_all_dim)^2 for latent attention (DeepSeek's correction of the longer context)."""
    scale = cfg.head_dim ** -0.5
    if cfg.is_latent and cfg.rope_type != "default" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def rotary_tables(cfg: ModelConfig, device=None) -> torch.Tensor:
    """cos/sin tables for rotary embeddings: (max_seq_len, rope_dim // 2, 2), YaRN's attention
    factor folded in (it scales the rotated channels of queries and keys alike)."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), rotary_frequencies(cfg, device))
    return torch.stack([angles.cos(), angles.sin()], dim=-1) * rotary_scale(cfg)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Channel pairs (x0, x1), (x2, x3), ... laid out as halves (x0, x2, ... | x1, x3, ...), so
    `apply_rotary`'s half layout rotates each interleaved pair (DeepSeek's `rope_interleave`).
    Queries and keys are permuted alike, so their dot products are unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x (batch, seq, heads, head_dim) by position.

    The "half" layout of Hugging Face checkpoints, so their q/k weights load unpermuted.
    `table` holds the rows of x's positions: (seq, head_dim/2, 2) when every sequence of the
    batch is at the same positions, or (batch, seq, head_dim/2, 2) when each has its own (a
    serving batch mixes sequences of different lengths)."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)  # each (batch, seq, heads, head_dim/2)
    rows = table[None] if table.dim() == 3 else table  # (batch or 1, seq, head_dim/2, 2)
    cos = rows[:, :, None, :, 0]  # (batch or 1, seq, 1, head_dim/2)
    sin = rows[:, :, None, :, 1]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).type_as(x)
