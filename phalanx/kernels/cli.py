"""The `match` and `blur` subcommands. Registering them imports no torch; running them does."""

from __future__ import annotations

import json
import sys

from phalanx.kernels.patterns import expand_inputs, read_inputs, read_patterns


def register(subparsers) -> None:
    m = subparsers.add_parser("match", help="every occurrence of many byte patterns in files (Wu-Manber / PFAC)",
                              description="Report every occurrence, overlapping ones included, of every pattern.")
    m.add_argument("inputs", nargs="+", metavar="INPUT", help="files, or folders (their files in sorted path order)")
    m.add_argument("--patterns", required=True, metavar="FILE",
                   help="one pattern per line, as bytes (split on \\n only, nothing stripped, empty lines skipped)")
    m.add_argument("--nproc", type=int, default=1, help="worker processes, each scanning a shard (default 1)")
    m.add_argument("--device", default="cpu", help="cpu or cuda")
    m.add_argument("--algorithm", default="auto", help="auto, wu-manber or pfac")
    m.add_argument("--positions", action="store_true", help="also report [input, offset, pattern] of each match")
    m.add_argument("--json", action="store_true", help="print one JSON object")
    m.set_defaults(func=run_match)

    b = subparsers.add_parser("blur", help="Gaussian blur of an image, tile by tile",
                              description="Separable Gaussian blur, equal to scipy.ndimage.gaussian_filter "
                                          "(mode reflect, truncate 4) per channel.")
    b.add_argument("input", metavar="IN", help="PNG, JPEG or .npy")
    b.add_argument("output", metavar="OUT", help="PNG, JPEG (rounded to integers) or .npy (float32)")
    b.add_argument("--sigma", type=float, required=True, help="standard deviation in pixels (> 0)")
    b.add_argument("--tiles", type=int, default=1, help="cut the image into T x T tiles (default 1)")
    b.add_argument("--nproc", type=int, default=1, help="worker processes sharing the tiles (default 1)")
    b.add_argument("--device", default="cpu", help="cpu or cuda")
    b.set_defaults(func=run_blur)


def run_match(args) -> int:
    # Imported when run, not at the top: it brings in numpy, torch, which start-up need not wait for.
    from phalanx.kernels.matching import choose_algorithm, match
    from phalanx.kernels.workers import check_device

    check_device(args.device, args.nproc)  # before the start line: a bad count is the only line
    patterns = read_patterns(args.patterns)
    names = expand_inputs(args.inputs)
    data = read_inputs(names)
    algorithm = choose_algorithm(patterns, args.algorithm)
    print(f"phalanx: matching {len(patterns)} patterns ({algorithm}) in {sum(map(len, data))} bytes of "
          f"{len(data)} input{'s' if len(data) != 1 else ''} on {args.nproc} process{'es' if args.nproc > 1 else ''}",
          file=sys.stderr)
    result = match(patterns, data, algorithm=algorithm, device=args.device, nproc=args.nproc, positions=args.positions)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['matches']} matches in {result['bytes']} bytes, {result['seconds']:.3f} s")
    for index, (pattern, count) in enumerate(zip(patterns, result["per_pattern"])):
        print(f"{count:>10}  pattern {index}: {pattern[:60]!r}")
    for input_index, offset, pattern_index in result.get("positions", []):
        print(f"{names[input_index]}:{offset}: pattern {pattern_index}")
    return 0


def run_blur(args) -> int:
    # Imported when run, not at the top: it brings in numpy, torch, which start-up need not wait for.
    from phalanx.kernels.gaussian_blur import blur, check_blur_args
    from phalanx.kernels.images import check_output_image, read_image, write_image
    from phalanx.kernels.workers import check_device

    check_device(args.device, args.nproc)
    check_output_image(args.output)
    image, kind = read_image(args.input)
    check_blur_args(image.shape, args.sigma, args.tiles)
    print(f"phalanx: blurring {args.input} {image.shape} with sigma {args.sigma} in {args.tiles} x {args.tiles} tiles "
          f"on {args.nproc} process{'es' if args.nproc > 1 else ''}", file=sys.stderr)
    write_image(args.output, blur(image, args.sigma, tiles=args.tiles, nproc=args.nproc, device=args.device), kind)
    return 0
