"""`phalanx.kernels.blur`: separable Gaussian blur cut into T x T tiles with halos.

Equal to scipy.ndimage.gaussian_filter(x, sigma, mode="reflect", truncate=4.0) per channel:
the same sampled kernel (radius int(4 sigma + 0.5), normalized to sum 1), the same border
(half-sample symmetric reflection). Each rank extends the image once by the radius (reflected
at its borders); a tile then reads its pixels plus a halo of one radius on every side (the
neighbours' pixels inside) as a view, and two 1-D "valid" correlations, rows then columns,
give exactly its part of the whole image's result, however small the tile is against the halo.
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
MAX_RADIUS_PER_SIDE = 8
"""The kernel's radius may reach this many times the image's longer side (halos longer than
the image are reflected again, as scipy does); beyond it the work and the padded copy grow
with sigma while the result barely changes."""
MIN_RADIUS_LIMIT = 1024
"""...but a small image may always take this radius (its padded copy: about 17 MB a channel)."""


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
    # Before any allocation: the kernel has 2 r + 1 taps and every rank pads the image by r.
    radius, limit = int(TRUNCATE * sigma + 0.5), max(MIN_RADIUS_LIMIT, MAX_RADIUS_PER_SIDE * max(shape[:2]))
    if radius > limit:
        raise UserError(f"--sigma {sigma:g}: a kernel radius of {radius:,} pixels on a {shape[0]} x {shape[1]} image; "
                        f"at most {limit:,} ({MAX_RADIUS_PER_SIDE} x its longer side, or {MIN_RADIUS_LIMIT}; "
                        f"--sigma {limit / TRUNCATE:g}): "
                        "a wider kernel only averages the image's reflections further, and its padding would need "
                        f"{4.0 * (shape[0] + 2.0 * radius) * (shape[1] + 2.0 * radius):.2g} bytes per channel")


# Rows of a tile filtered together on the CPU: about 512 KB of float32 per strip (half of this
# machine's 1 MB L2), so the 2 x (2 r + 1) passes over a strip run in the core's cache instead
# of main memory; at least 32 rows, so a wide halo is not re-read for every few rows.
STRIP_BYTES = 512 << 10


def _valid_along(x: torch.Tensor, weights: list[float], dim: int) -> torch.Tensor:
    """'Valid' correlation with `weights` along `dim`, as a weighted sum of shifted slices
    (one fused multiply-add over the tile per tap: faster than conv1d over millions of
    one-channel lines, and the same on every device)."""
    size = x.shape[dim] - len(weights) + 1
    out = x.narrow(dim, 0, size) * weights[0]
    for tap, weight in enumerate(weights[1:], start=1):
        out.add_(x.narrow(dim, tap, size), alpha=weight)
    return out


def pad_reflect(image: torch.Tensor, radius: int) -> torch.Tensor:
    """(C, H, W) -> (C, H + 2 r, W + 2 r), extended as scipy's "reflect" (half-sample
    symmetric, repeated for halos longer than the image): only the halo strips are gathered,
    the rest is copied whole."""
    for dim in (1, 2):
        size = image.shape[dim]
        before = torch.tensor(reflect_index(-radius, 0, size), device=image.device, dtype=torch.int64)
        after = torch.tensor(reflect_index(size, size + radius, size), device=image.device, dtype=torch.int64)
        image = torch.cat([image.index_select(dim, before), image, image.index_select(dim, after)], dim=dim)
    return image


def blur_tile(padded: torch.Tensor, tile: Tile, weights: list[float]) -> torch.Tensor:
    """padded (C, H + 2 r, W + 2 r) float32 on the device (pad_reflect of the image) -> the
    blurred (C, h, w) of this tile: its pixels plus a halo of r on every side, filtered rows
    then columns (as scipy filters: axis 0 first)."""
    radius = (len(weights) - 1) // 2
    (top, bottom), (left, right) = tile.rows, tile.cols
    region = padded[:, top : bottom + 2 * radius, left : right + 2 * radius]  # a view: the tile and its halo
    height = bottom - top
    if padded.device.type != "cpu":  # one launch per tap over the whole tile
        return _valid_along(_valid_along(region, weights, 1), weights, 2)
    out = torch.empty((padded.shape[0], height, right - left), dtype=padded.dtype)
    strip = max(32, STRIP_BYTES // (4 * region.shape[0] * region.shape[2]) - 2 * radius)
    for row in range(0, height, strip):
        rows = min(strip, height - row)
        band = region[:, row : row + rows + 2 * radius]
        out[:, row : row + rows] = _valid_along(_valid_along(band, weights, 1), weights, 2)
    return out


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
    weights = gaussian_kernel(job.sigma).tolist()
    padded = pad_reflect(torch.from_numpy(job.image).to(device), (len(weights) - 1) // 2)
    done = {i: blur_tile(padded, job.tiles[i], weights) for i in range(rank, len(job.tiles), world_size)}
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
