"""How work is cut into pieces: text shards with overlap, image tiles with halos. Torch-free.

Text: shard i owns the match starts in [own_start, own_end) and reads the bytes
[own_start, read_end) with read_end = own_end + (longest pattern - 1) (clipped to the text).
Every match starting in the owned range therefore lies wholly in what the shard reads, and
each start is owned by exactly one shard: nothing lost across a boundary, nothing counted twice.

Image: T x T tiles; each tile reads its rows and columns plus a halo of the kernel radius on
every side, so a "valid" convolution of what it read is exactly its part of the whole result.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextShard:
    own_start: int
    own_end: int
    read_end: int


def even_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering [0, length), sizes differing by at most one."""
    cuts = [length * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def text_shards(length: int, parts: int, overlap: int) -> list[TextShard]:
    """Split [0, length) into `parts` owned ranges (empty ones dropped), each read with `overlap`
    extra bytes after its end."""
    return [TextShard(a, b, min(length, b + overlap)) for a, b in even_bounds(length, parts) if b > a]


def rank_chunks(length: int, rank: int, world_size: int, overlap: int, chunk_bytes: int) -> list[TextShard]:
    """The shards rank `rank` scans: its 1/world_size of the text, cut again into pieces of at
    most `chunk_bytes` owned bytes so the device's lanes (one per byte) fit in memory."""
    own_start, own_end = even_bounds(length, world_size)[rank]
    pieces = max(1, -(-(own_end - own_start) // chunk_bytes))
    return [TextShard(own_start + s.own_start, own_start + s.own_end, min(length, own_start + s.own_end + overlap))
            for s in text_shards(own_end - own_start, pieces, 0)]


@dataclass(frozen=True)
class Tile:
    rows: tuple[int, int]  # output rows [start, end) this tile writes
    cols: tuple[int, int]  # output columns [start, end)


def image_tiles(height: int, width: int, tiles: int) -> list[Tile]:
    """T x T tiles in row-major order; with T larger than a side, that side's empty tiles are
    dropped (a 3-row image cut 8 ways has 3 row bands)."""
    # More cuts than pixels give one-pixel bands either way: cut at most once per pixel, so
    # the work is bounded by the image, not by --tiles.
    return [Tile(r, c) for r in even_bounds(height, min(tiles, height)) if r[1] > r[0]
            for c in even_bounds(width, min(tiles, width)) if c[1] > c[0]]


def reflect_index(start: int, end: int, size: int) -> list[int]:
    """Source indices of positions [start, end) of a line of `size` samples extended by
    half-sample symmetric reflection (d c b a | a b c d | d c b a), repeated for halos longer
    than the line: scipy.ndimage's mode "reflect"."""
    period = 2 * size
    out = []
    for i in range(start, end):
        j = i % period
        out.append(j if j < size else period - 1 - j)
    return out
