"""`phalanx.kernels.blur`: separable Gaussian blur cut into T x T tiles with halos.

Equal to scipy.ndimage.gaussian_filter(x, sigma, mode="reflect", truncate=4.0) per channel:
the same sampled kernel (radius int(4 sigma + 0.5), normalized to sum 1), the same border
(half-sample symmetric reflection). Each tile gathers its pixels plus a halo of one radius on
every side (reflected at the image's borders, the neighbours' pixels inside), then two 1-D
"valid" correlations, rows then columns, give exactly its part of the whole image's result,
however small the tile is against the halo.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from phalanx.errors import UserError
from phalanx.kernels.shards import Tile, image_tiles, reflect_index
from phalanx.kernels.workers import run_sharded, worker_device

TRUNCATE = 4.0


def gaussian_kernel(sigma: float) -> np.ndarray:
    """(2 r + 1,) float64 weights, r = int(4 sigma + 0.5), as scipy.ndimage samples them."""
    radius = int(TRUNCATE * sigma + 0.5)
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    weights = np.exp(-0.5 / (sigma * sigma) * x * x)
    return weights / weights.sum()


def check_blur_args(shape: tuple[int, ...], sigma: float, tiles: int) -> None:
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise UserError(f"--sigma {sigma}: must be a number above 0")
    if not isinstance(tiles, int) or tiles < 1:
        raise UserError(f"--tiles {tiles}: must be a whole number of at least 1 (T x T tiles)")
    if len(shape) not in (2, 3) or 0 in shape:
        raise UserError(f"an image of shape {shape}: expected (height, width) or (height, width, channels), none empty")


def _valid_along(x: torch.Tensor, weights: list[float], dim: int) -> torch.Tensor:
    """'Valid' correlation with `weights` along `dim`, as a weighted sum of shifted slices
    (one fused multiply-add over the tile per tap: faster than conv1d over millions of
    one-channel lines, and the same on every device)."""
    size = x.shape[dim] - len(weights) + 1
    out = x.narrow(dim, 0, size) * weights[0]
    for tap, weight in enumerate(weights[1:], start=1):
        out.add_(x.narrow(dim, tap, size), alpha=weight)
    return out


def blur_tile(image: torch.Tensor, tile: Tile, weights: list[float]) -> torch.Tensor:
    """image (C, H, W) float32 on the device -> the blurred (C, h, w) of this tile."""
    channels, height, width = image.shape
    radius = (len(weights) - 1) // 2
    device = image.device
    rows = torch.tensor(reflect_index(tile.rows[0] - radius, tile.rows[1] + radius, height), device=device)
    cols = torch.tensor(reflect_index(tile.cols[0] - radius, tile.cols[1] + radius, width), device=device)
    region = image.index_select(1, rows).index_select(2, cols)  # (C, h + 2r, w + 2r)
    # Rows first (axis 0), as scipy filters: (C, h, w + 2r), then columns: (C, h, w).
    return _valid_along(_valid_along(region, weights, 1), weights, 2)


@dataclass(frozen=True)
class BlurJob:
    image: np.ndarray  # (C, H, W) float32
    sigma: float
    tiles: list[Tile]
    device: str


def blur_rank(rank: int, world_size: int, job: BlurJob) -> dict:
    """Tiles rank, rank + N, rank + 2N, ... of the job: {"tiles": {index: (C, h, w) array}, "seconds"}."""
    began = time.perf_counter()
    device = worker_device(job.device)
    image = torch.from_numpy(job.image).to(device)
    weights = gaussian_kernel(job.sigma).tolist()
    done = {i: blur_tile(image, job.tiles[i], weights) for i in range(rank, len(job.tiles), world_size)}
    done = {i: out.cpu().numpy() for i, out in done.items()}
    return {"tiles": done, "seconds": time.perf_counter() - began}


def blur(array, sigma: float, *, tiles: int = 1, nproc: int = 1, device: str = "cpu") -> np.ndarray:
    """Gaussian blur of a (H, W) or (H, W, C) array, each channel on its own; float32, same shape."""
    array = np.asarray(array)
    check_blur_args(array.shape, sigma, tiles)
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise UserError(f"an image of dtype {array.dtype}: expected numbers")
    planes = array.astype(np.float32)[..., None] if array.ndim == 2 else array.astype(np.float32)
    image = np.ascontiguousarray(np.moveaxis(planes, -1, 0))  # (C, H, W)
    job = BlurJob(image, float(sigma), image_tiles(image.shape[1], image.shape[2], tiles), device)
    out = np.empty_like(image)
    for result in run_sharded(blur_rank, job, nproc, device):
        for index, values in result["tiles"].items():
            tile = job.tiles[index]
            out[:, tile.rows[0] : tile.rows[1], tile.cols[0] : tile.cols[1]] = values
    out = np.moveaxis(out, 0, -1)
    return out[..., 0].copy() if array.ndim == 2 else np.ascontiguousarray(out)
