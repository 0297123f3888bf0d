"""`phalanx.kernels.blur` equals scipy.ndimage.gaussian_filter(x, sigma, mode="reflect",
truncate=4.0) per channel, for any tile count, odd sizes, sigma 0.5 to 20 (tiles smaller than
the halo included), 2-D and 3-channel, and on 2 worker processes.

Tolerance 1e-5 (max abs) on values in [0, 1): phalanx filters in float32 while the reference
runs in float64; float32 keeps ~7 digits and a kernel of up to 161 taps sums to 1, so the
rounding error stays near 1e-6."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.ndimage import gaussian_filter

from phalanx.cli import main
from phalanx.errors import UserError
from phalanx.kernels import blur
from phalanx.testing.cli_errors import assert_cli_error


def reference(x: np.ndarray, sigma: float) -> np.ndarray:
    x = x.astype(np.float64)
    if x.ndim == 2:
        return gaussian_filter(x, sigma, mode="reflect", truncate=4.0)
    return np.stack([gaussian_filter(x[..., c], sigma, mode="reflect", truncate=4.0) for c in range(x.shape[2])], -1)


@pytest.mark.parametrize("shape", [(37, 23), (19, 41, 3), (1, 9), (64, 7)])
@pytest.mark.parametrize("sigma", [0.5, 1.7, 6.0, 20.0])
def test_equal_to_scipy_for_any_tiling(shape, sigma):
    x = np.random.default_rng(sum(shape)).random(shape, dtype=np.float32)
    expected = reference(x, sigma)
    for tiles in (1, 3, 8):  # 8 tiles of a 37-row image: 4-5 rows each, under any halo here but sigma 0.5's
        out = blur(x, sigma, tiles=tiles)
        assert out.dtype == np.float32 and out.shape == x.shape
        assert np.abs(out - expected).max() < 1e-5, (tiles, np.abs(out - expected).max())


def test_two_worker_processes():
    x = np.random.default_rng(5).random((45, 33, 3), dtype=np.float32)
    out = blur(x, 2.5, tiles=3, nproc=2)
    assert np.abs(out - reference(x, 2.5)).max() < 1e-5


def test_integer_input_is_blurred_as_float():
    x = np.random.default_rng(6).integers(0, 256, (20, 30)).astype(np.uint8)
    assert np.abs(blur(x, 1.5, tiles=2) - reference(x, 1.5)).max() < 1e-3  # values up to 255: 1e-5 relative


def test_png_and_npy_files(tmp_path):
    """8-bit PNG out is scipy's result rounded to the nearest integer (a tie or a value a
    float32 rounding away from .5 may round the other way: at most 1 apart, rarely); .npy out
    keeps float32."""
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 256, (30, 25, 3)).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "in.png")
    with pytest.raises(SystemExit) as exit_info:
        main(["blur", str(tmp_path / "in.png"), str(tmp_path / "out.png"), "--sigma", "2", "--tiles", "2"])
    assert exit_info.value.code == 0
    out = np.asarray(Image.open(tmp_path / "out.png"))
    expected = np.rint(reference(pixels, 2.0))
    assert out.dtype == np.uint8 and out.shape == pixels.shape
    assert np.abs(out.astype(int) - expected).max() <= 1 and (out == expected).mean() > 0.99
    np.save(tmp_path / "in.npy", pixels[..., 0].astype(np.float32) / 255)
    with pytest.raises(SystemExit):
        main(["blur", str(tmp_path / "in.npy"), str(tmp_path / "out.npy"), "--sigma", "3"])
    saved = np.load(tmp_path / "out.npy")
    assert saved.dtype == np.float32
    assert np.abs(saved - reference(pixels[..., 0].astype(np.float32) / 255, 3.0)).max() < 1e-5


def _fails(argv, capsys, message):
    assert_cli_error(["blur", *argv], capsys, message, one_line=False)


def test_bad_input(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((4, 4), np.float32))
    good = [str(tmp_path / "x.npy"), str(tmp_path / "y.npy")]
    _fails([*good, "--sigma", "0"], capsys, "must be a number above 0")
    _fails([*good, "--sigma", "-1"], capsys, "must be a number above 0")
    _fails([*good, "--sigma", "nan"], capsys, "must be a number above 0")
    _fails([*good, "--sigma", "1", "--tiles", "0"], capsys, "at least 1")
    _fails([str(tmp_path / "none.png"), str(tmp_path / "y.png"), "--sigma", "1"], capsys, "does not exist")
    (tmp_path / "fake.png").write_bytes(b"this is not a picture")
    _fails([str(tmp_path / "fake.png"), str(tmp_path / "y.png"), "--sigma", "1"], capsys, "is not an image")
    np.save(tmp_path / "flat.npy", np.zeros(5, np.float32))
    _fails([str(tmp_path / "flat.npy"), str(tmp_path / "y.npy"), "--sigma", "1"], capsys, "expected (height, width)")
    with pytest.raises(UserError, match="must be a number above 0"):
        blur(np.zeros((3, 3)), 0.0)
