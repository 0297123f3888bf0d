"""Tiled Gaussian blur: phalanx on 1, 2 and 4 processes against scipy.ndimage.gaussian_filter,
same image, same run.

A 4096 x 4096 float32 image (random values), sigma 3 (radius 12), cut into 4 x 4 tiles.
phalanx's time is the whole `blur` call as a user sees it, worker start included; the largest
difference from scipy is printed too. Ratio: scipy's time over phalanx's (above 1: faster).

    .venv/bin/python benchmarks/blur_tiles.py [--size 4096] [--device cuda] [--threads N] [--nproc 1,2,4]

--threads sets torch's threads in this process; phalanx's CPU ranks run on one thread each
whatever it says (phalanx/kernels/workers.py), so it no longer changes phalanx's times; scipy
uses one thread.

--device cuda also reports the blur alone on the GPU (image already there) and end to end.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from scipy.ndimage import gaussian_filter

from phalanx.kernels import blur


def kernel_only_cuda(image: np.ndarray, sigma: float, tiles: int) -> float:
    import torch

    from phalanx.kernels.gaussian_blur import blur_tile, gaussian_kernel, pad_reflect
    from phalanx.kernels.shards import image_tiles

    on_gpu = torch.from_numpy(image[None]).cuda()  # (1, H, W)
    weights = gaussian_kernel(sigma).tolist()
    pieces = image_tiles(image.shape[0], image.shape[1], tiles)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        padded = pad_reflect(on_gpu, (len(weights) - 1) // 2)
        for tile in pieces:
            blur_tile(padded, tile, weights)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--sigma", type=float, default=3.0)
    parser.add_argument("--tiles", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads here (0: torch's default)")
    parser.add_argument("--nproc", default="1,2,4",
                        help="process counts to time phalanx on (default 1,2,4; one GPU: 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    image = np.random.default_rng(0).random((args.size, args.size), dtype=np.float32)
    began = time.perf_counter()
    expected = gaussian_filter(image, args.sigma, mode="reflect", truncate=4.0)
    scipy_s = time.perf_counter() - began
    print(f"{args.size} x {args.size} float32, sigma {args.sigma}, {args.tiles} x {args.tiles} tiles, --device {args.device}, "
          f"{torch.get_num_threads()} torch threads in-process")
    print(f"  {'scipy gaussian_filter':28s} {scipy_s:8.3f} s")
    if args.device == "cuda":  # CUDA's context and first kernels outside the clock
        blur(image[:64, :64], args.sigma, tiles=1, device="cuda")
    for nproc in (int(n) for n in args.nproc.split(",")):
        began = time.perf_counter()
        out = blur(image, args.sigma, tiles=args.tiles, nproc=nproc, device=args.device)
        took = time.perf_counter() - began
        print(f"  {f'phalanx, {nproc} process' + ('es' if nproc > 1 else ''):28s} {took:8.3f} s  "
              f"ratio scipy/phalanx {scipy_s / took:5.2f}  max |diff| {np.abs(out - expected).max():.1e}")
    if args.device == "cuda":
        print(f"  {'phalanx kernel only (GPU)':28s} {kernel_only_cuda(image, args.sigma, args.tiles):8.3f} s")


if __name__ == "__main__":
    main()
