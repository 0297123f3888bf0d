"""The sampler's draw for a batch of rows: phalanx's (`inference/sampling.py`: the whole
vocabulary in place, inverse distribution with one uniform number per row) against what it did
before (every row sorted by `topk(vocab)`, then `torch.multinomial` per row with the row's
generator), in the same process, alternating call by call. Rows sample at temperature 1 with
no top_k or top_p cut (what an OpenAI request without them asks), each with its own seeded
generator, at 2,048 (serve_aiperf.py's word vocabulary), 32,000 (Llama 2, Mistral) and 151,936
(Qwen) tokens, 1 and 32 rows. Prints milliseconds per call (median) and the ratio.

Reproduce:  .venv/bin/python benchmarks/sampling_draw.py [--threads 1] [--calls 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from phalanx.inference.sampling import Row, Sampling, sample


def before(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """The draw as it was: a sort of every row, then a multinomial call per row."""
    values, choices = (logits / 1.0).topk(logits.shape[-1])
    probs = values.softmax(-1)
    picked = [torch.multinomial(probs[index], 1, generator=row.generator) for index, row in enumerate(rows)]
    return choices.gather(1, torch.stack(picked)).flatten().tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.calls} calls each, alternated")
    print(f"{'vocab':>8} {'rows':>5} {'before ms':>10} {'phalanx ms':>11} {'speed-up':>9}")
    for vocab in (2048, 32000, 151936):
        for count in (1, 32):
            logits = torch.randn(count, vocab, generator=torch.Generator().manual_seed(vocab + count)) * 3
            sampling = Sampling(temperature=1.0, top_k=0)
            rows = [Row(sampling, torch.Generator().manual_seed(index)) for index in range(count)]
            times: dict[str, list[float]] = {"before": [], "phalanx": []}
            for _ in range(args.calls):
                for name, draw in (("before", before), ("phalanx", sample)):
                    began = time.perf_counter()
                    draw(logits, rows)
                    times[name].append(time.perf_counter() - began)
            old, new = (statistics.median(times[name]) * 1e3 for name in ("before", "phalanx"))
            print(f"{vocab:>8} {count:>5} {old:>10.2f} {new:>11.2f} {old / new:>8.1f}x")


if __name__ == "__main__":
    main()
