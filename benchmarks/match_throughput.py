"""Multi-pattern matching: phalanx (tensor Wu-Manber / PFAC) against a serial Wu-Manber in
plain Python (the paper's algorithm, one thread), pyahocorasick and hyperscan, in one run.

Texts: the Python standard library's source (about 5 MB of .py files in sorted path order) with
100, 1,000 and 10,000 patterns drawn from it (8 to 32 bytes, no newline), and 8 MB of random
DNA with 100 and 1,000 random patterns of length 8. Each tool's time is its matching alone
(building its tables or automaton, then counting every occurrence), the best of `--repeats`;
all tools must agree on the count. Ratios: the other tool's time over phalanx's (above 1:
phalanx is faster).

    .venv/bin/python benchmarks/match_throughput.py [--quick] [--device cuda] [--nproc N] [--threads N]
        [--mb MB] [--patterns 100,1000,10000]

--threads sets torch's threads in this process; phalanx's CPU ranks run on one thread each
whatever it says (phalanx/kernels/workers.py), so it no longer changes phalanx's times. The other tools run on one thread.

--device cuda also reports phalanx's kernel alone (tables and text already on the GPU) and
end to end (including the host-to-device copy of the text).
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from match_serial_wu_manber import count_matches  # noqa: E402

from phalanx.kernels import match  # noqa: E402
from phalanx.kernels.matching import choose_algorithm  # noqa: E402


def stdlib_text(limit: int) -> bytes:
    out = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        out += path.read_bytes()
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def drawn_patterns(text: bytes, count: int, rng: random.Random) -> list[bytes]:
    chosen: dict[bytes, None] = {}
    while len(chosen) < count:
        start = rng.randrange(len(text) - 32)
        pattern = text[start : start + rng.randint(8, 32)]
        if b"\n" not in pattern:
            chosen[pattern] = None
    return list(chosen)


def best(fn, repeats: int) -> tuple[float, int]:
    times, total = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        total = fn()
        times.append(time.perf_counter() - began)
    return min(times), total


def pyahocorasick_count(patterns: list[bytes], text: bytes):
    try:
        import ahocorasick
    except ImportError:
        return None

    def run() -> int:
        automaton = ahocorasick.Automaton()
        for index, pattern in enumerate(patterns):
            automaton.add_word(pattern.decode("latin-1"), index)
        automaton.make_automaton()
        return sum(1 for _ in automaton.iter(text.decode("latin-1")))

    return run


def hyperscan_count(patterns: list[bytes], text: bytes):
    try:
        import hyperscan
    except ImportError:
        return None

    def run() -> int:
        database = hyperscan.Database()
        database.compile(expressions=patterns, ids=list(range(len(patterns))), elements=len(patterns), literal=True)
        found = [0]

        def on_match(*_):
            found[0] += 1

        database.scan(text, match_event_handler=on_match)
        return found[0]

    return run


def kernel_only_cuda(patterns: list[bytes], text: bytes, repeats: int) -> float:
    """phalanx's scan alone on the GPU: tables built and text copied before the clock starts."""
    import torch

    from phalanx.kernels import pfac, wu_manber

    engine = wu_manber if choose_algorithm(patterns) == "wu-manber" else pfac
    tables = engine.build_tables(patterns, "cuda")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).cuda()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        began = time.perf_counter()
        engine.scan(tables, data)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 MB texts instead of 5 and 8 MB")
    parser.add_argument("--mb", type=float, default=0.0, help="both texts this many MB (overrides --quick; 0: default)")
    parser.add_argument("--patterns", default="100,1000,10000",
                        help="pattern counts drawn from the source text (DNA: those up to 1000; default 100,1000,10000)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--nproc", type=int, default=1, help="phalanx worker processes")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-serial", action="store_true", help="leave out the (slow) serial Wu-Manber")
    parser.add_argument("--threads", type=int, default=0, help="torch threads here (0: torch's default)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    counts = [int(k) for k in args.patterns.split(",")]
    source_bytes, dna_bytes = (int(args.mb * 2**20),) * 2 if args.mb else (1 << 20, 1 << 20) if args.quick else (5 << 20, 8 << 20)
    source = stdlib_text(source_bytes)
    dna = bytes(rng.choice(b"ACGT") for _ in range(dna_bytes))
    cases = [(f"stdlib {len(source) / 2**20:.1f} MB", source, drawn_patterns(source, k, rng)) for k in counts]
    cases += [(f"DNA {len(dna) / 2**20:.1f} MB", dna, sorted({bytes(rng.choice(b"ACGT") for _ in range(8)) for _ in range(k * 2)})[:k])
              for k in counts if k <= 1000]
    print(f"phalanx: --device {args.device} --nproc {args.nproc}, {torch.get_num_threads()} torch threads in-process; "
          f"times are the best of {args.repeats}; "
          "ratio = other tool's time / phalanx's")
    for name, text, patterns in cases:
        runs = {}
        seconds, total = [], None
        for _ in range(args.repeats):
            result = match(patterns, [text], device=args.device, nproc=args.nproc)
            seconds.append(result["seconds"])
            total = result["matches"]
        runs["phalanx"] = (min(seconds), total)
        references = {"serial Wu-Manber (Python)": None if args.skip_serial else (lambda: sum(count_matches(patterns, text))),
                      "pyahocorasick": pyahocorasick_count(patterns, text), "hyperscan (1 thread)": hyperscan_count(patterns, text)}
        print(f"\n{name}, {len(patterns)} patterns, phalanx algorithm {choose_algorithm(patterns)}:")
        print(f"  {'phalanx':28s} {runs['phalanx'][0]:8.3f} s  {total} matches")
        if args.device == "cuda":
            kernel = kernel_only_cuda(patterns, text, max(args.repeats, 3))
            print(f"  {'phalanx kernel only (GPU)':28s} {kernel:8.3f} s")
        for label, run in references.items():
            if run is None:
                print(f"  {label:28s} {'skipped' if 'serial' in label else 'not installed'}")
                continue
            took, count = best(run, args.repeats)
            agree = "" if count == total else f"  COUNT DIFFERS: {count}"
            print(f"  {label:28s} {took:8.3f} s  ratio {took / runs['phalanx'][0]:6.2f}{agree}")


if __name__ == "__main__":
    main()
