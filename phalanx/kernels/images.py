"""Image files for `phalanx blur`: PNG/JPEG through Pillow, or .npy arrays. Torch-free."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from phalanx.errors import UserError
from phalanx.output_path import check_output_file

EIGHT_BIT_MODES = ("L", "LA", "RGB", "RGBA")
OUTPUT_SUFFIXES = (".png", ".jpg", ".jpeg", ".npy")


def _png_bit_depth(path: Path) -> tuple[int, int] | None:
    """(bit depth, colour type) from a PNG's IHDR chunk, which Pillow does not keep: it reads
    16-bit colour PNGs as 8 bits per channel."""
    with path.open("rb") as file:
        head = file.read(26)
    if len(head) < 26 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return head[24], head[25]


def check_output_image(path: str | Path) -> Path:
    """The output's kind and place, before the input is read or anything blurred."""
    path = Path(path)
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise UserError(f"output {path}: use a .png, .jpg, .jpeg or .npy name")
    return check_output_file(path, "output")


def read_image(path: str | Path) -> tuple[np.ndarray, str]:
    """(array (H, W) or (H, W, C), kind) with kind "npy", "8bit" or "16bit"."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"image {path} does not exist")
    if path.suffix.lower() == ".npy":
        try:
            return np.load(path, allow_pickle=False), "npy"
        except (OSError, ValueError) as error:
            raise UserError(f"{path} is not a readable .npy array: {error}") from None
    # Imported when run, not at the top: it brings in PIL, which start-up need not wait for.
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            if image.mode in ("I;16", "I;16B", "I;16L", "I"):
                return np.asarray(image, dtype=np.float32), "16bit"
            depth = _png_bit_depth(path) if image.format == "PNG" else None
            if depth and depth[0] == 16:  # colour or grey+alpha: Pillow keeps only the high bytes
                print(f"phalanx: warning: {path} has 16 bits per channel; Pillow reads its colour channels as "
                      "8 bits, so the blur sees 8-bit values (save it as a .npy array to keep 16 bits)", file=sys.stderr)
            if image.mode not in EIGHT_BIT_MODES:
                image = image.convert("RGBA" if "A" in image.getbands() or "transparency" in image.info else "RGB")
            return np.asarray(image), "8bit"
    except (UnidentifiedImageError, OSError) as error:
        raise UserError(f"{path} is not an image Pillow can read ({error})") from None


def write_image(path: str | Path, array: np.ndarray, kind: str) -> None:
    """.npy keeps float32; PNG/JPEG rounds to the nearest integer (8-bit, or 16-bit for a
    16-bit grey input written as PNG), clipped to the format's range."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".npy":
        np.save(path, array.astype(np.float32))
        return
    if suffix not in (".png", ".jpg", ".jpeg"):
        raise UserError(f"output {path}: use a .png, .jpg, .jpeg or .npy name")
    # Imported when run, not at the top: it brings in PIL, which start-up need not wait for.
    from PIL import Image

    if kind == "16bit" and suffix == ".png" and array.ndim == 2:
        Image.fromarray(np.clip(np.rint(array), 0, 65535).astype(np.uint16)).save(path)
        return
    if array.ndim == 3 and array.shape[2] not in (1, 2, 3, 4):
        raise UserError(f"an array with {array.shape[2]} channels cannot be written as {suffix}; use .npy")
    if kind == "npy" and array.size and 0 <= float(array.min()) and float(array.max()) <= 1:
        print(f"phalanx: warning: the values are within [0, 1]; {suffix} stores whole numbers 0 to 255, so they "
              "round to 0 and 1 (write .npy to keep them, or scale the input to 0..255)", file=sys.stderr)
    pixels = np.clip(np.rint(array), 0, 255).astype(np.uint8)
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[..., 0]
    image = Image.fromarray(pixels)
    if suffix != ".png" and image.mode in ("LA", "RGBA"):
        image = image.convert("RGB" if image.mode == "RGBA" else "L")  # JPEG has no alpha
    try:
        image.save(path)
    except OSError as error:
        raise UserError(f"cannot write {path}: {error}") from None
