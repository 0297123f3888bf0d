"""`phalanx serve --speculative-config` (prompt lookup) against the same server without it, on
the same checkpoint and requests, servers alternated (A B B A ...) in the same run.

The checkpoint is serve_aiperf.py's random llama (hidden 512, 4 layers, fp32, a word-level
tokenizer). A random model's greedy continuation soon repeats itself, which is what prompt
lookup guesses from: this measures the mechanism's cost and gain where guesses are often kept,
not the acceptance of a real model on real text (which depends on the text: the rate is
printed so that the two can be set side by side). Requests: greedy completions of `--osl`
tokens (`ignore_eos`) from prompts of `--isl` random words, a closed loop of `--concurrency`
clients with the real `openai` client. Prints per concurrency each arm's median output tokens/s
over the rounds, the ratio, and the acceptance rate the server's /metrics gave.

Reproduce:  .venv/bin/python benchmarks/serve_speculative.py [--concurrency 1 8] [--rounds 2] [--k 4]
                [--disable-by-batch-size 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_aiperf import NAME, VOCAB, write_model  # noqa: E402 (the path above first)


def run_load(server, prompts: list[str], osl: int, concurrency: int) -> float:
    """Output tokens/s of a closed loop of `concurrency` clients over `prompts`."""
    client = server.client()

    def complete(prompt: str) -> int:
        answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=osl, temperature=0,
                                           extra_body={"ignore_eos": True})
        return answer.usage.completion_tokens

    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(complete, prompts))
    return tokens / (time.monotonic() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="the config's disable_by_batch_size (default: none, guesses at any batch)")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency and arm")
    args = parser.parse_args()
    from tests.serve_server import ServeProcess

    config = f'{{"method": "ngram", "num_speculative_tokens": {args.k}'
    config += "}" if args.disable_by_batch_size is None else f', "disable_by_batch_size": {args.disable_by_batch_size}}}'
    arms = {"plain": (), "guessing": ("--speculative-config", config)}
    speeds: dict[tuple[str, int], list[float]] = {}
    rates: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model")
        for round_index in range(args.rounds):
            order = list(arms) if round_index % 2 == 0 else list(arms)[::-1]
            for arm in order:
                server = ServeProcess(model, "--served-model-name", NAME, *arms[arm])
                try:
                    for concurrency in args.concurrency:
                        rng = random.Random(1000 * round_index + concurrency)  # the same prompts for both arms
                        prompts = [" ".join(f"w{rng.randrange(1, VOCAB)}" for _ in range(args.isl))
                                   for _ in range(max(args.requests, concurrency))]
                        speed = run_load(server, prompts, args.osl, concurrency)
                        speeds.setdefault((arm, concurrency), []).append(speed)
                        print(f"  round {round_index} {arm} concurrency {concurrency}: {speed:.1f} tokens/s", flush=True)
                    if arm == "guessing":
                        rates.append(server.metrics()["phalanx_spec_decode_acceptance_rate"])
                finally:
                    server.stop()
    print(f"phalanx serve, prompt lookup {config} vs none, random llama hidden 512 x 4 layers (fp32), greedy, "
          f"{args.isl} prompt / {args.osl} output tokens, median of {args.rounds} alternated rounds")
    print(f"acceptance rate per round: {', '.join(f'{rate:.2f}' for rate in rates)}")
    print(f"{'conc':>4} {'plain tok/s':>12} {'guessing tok/s':>15} {'guessing/plain':>15}")
    for concurrency in args.concurrency:
        plain = statistics.median(speeds[("plain", concurrency)])
        guessing = statistics.median(speeds[("guessing", concurrency)])
        print(f"{concurrency:>4} {plain:>12.1f} {guessing:>15.1f} {guessing / plain:>15.2f}")


if __name__ == "__main__":
    main()
