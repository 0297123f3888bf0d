"""Rotary position embeddings: the frequency of each channel pair, the cos/sin table over
positions, and the rotation itself. Shared by every attention variant."""

from __future__ import annotations

import math

import torch

from phalanx.model.config import ModelConfig


def rotary_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Angle per position step of each channel pair (head_dim // 2,), with Llama 3.1's scaling:
    wavelengths longer than the original context are stretched by `rope_factor`, shorter than
    original / high_freq_factor kept, and the band between blended smoothly."""
    head_dim = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if cfg.rope_type != "llama3":
        return inv_freq
    original = cfg.rope_original_max_seq_len
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / cfg.rope_low_freq_factor, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (original / wavelength - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    blended = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelength >= original / cfg.rope_high_freq_factor) & (wavelength <= original / cfg.rope_low_freq_factor)
    return torch.where(medium, blended, scaled)


def rotary_tables(cfg: ModelConfig, device=None) -> torch.Tensor:
    """cos/sin tables for rotary embeddings: (max_seq_len, head_dim // 2, 2)."""
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), rotary_frequencies(cfg, device))
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


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
