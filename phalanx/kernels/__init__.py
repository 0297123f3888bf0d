"""Data parallelism outside training: multi-pattern matching and tiled Gaussian blur, sharded
over processes and run as tensor operations on CPU or CUDA (docs/kernels.md).

`match` and `blur` are imported on first use, so that `phalanx` can register the `match` and
`blur` subcommands without loading torch.
"""

__all__ = ["blur", "match"]


def __getattr__(name: str):
    if name == "match":
        # Imported when run, not at the top: it brings in numpy, torch, which start-up need not wait for.
        from phalanx.kernels.matching import match

        return match
    if name == "blur":
        # Imported when run, not at the top: it brings in numpy, torch, which start-up need not wait for.
        from phalanx.kernels.gaussian_blur import blur

        return blur
    raise AttributeError(f"module 'phalanx.kernels' has no attribute {name!r}")
