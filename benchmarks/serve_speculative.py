"""`phalanx serve --speculative-config` (prompt lookup, or with `--method deepseek_mtp`
DeepSeek-V3's multi-token-prediction draft) against the same server without it, on the same
checkpoint and requests, servers alternated (A B B A ...) in the same run.

The checkpoint is serve_aiperf.py's random llama (hidden 512, 4 layers, fp32, a word-level
tokenizer). A random model's greedy continuation soon repeats itself, which is what prompt
lookup guesses from: this measures the mechanism's cost and gain where guesses are often kept,
not the acceptance of a real model on real text (which depends on the text: the rate is
printed so that the two can be set side by side). Requests: greedy completions of `--osl`
tokens (`ignore_eos`) from prompts of `--isl` random words, a closed loop of `--concurrency`
clients with the real `openai` client. Prints per concurrency each arm's median output tokens/s
over the rounds, the ratio, and the acceptance rate the server's /metrics gave.

`--method deepseek_mtp`: a random DeepSeek-V3 (hidden 256, 4 layers, 8 routed experts, vocab
1024, fp32) with an MTP layer whose draft is right by construction
(tests/deepseek_models.write_deepseek_mtp(bigram=True): the model's next token depends on the
last token alone and the draft is that token): the mechanism's cost and gain where nearly every
draft is kept, not a real checkpoint's acceptance. Its prompts are random token ids (it has no
tokenizer), one token guessed a step unless `--k` says more.

Reproduce:  .venv/bin/python benchmarks/serve_speculative.py [--concurrency 1 8] [--rounds 2] [--k 4]
                [--disable-by-batch-size 4]
            .venv/bin/python benchmarks/serve_speculative.py --method deepseek_mtp [--concurrency 1 8] [--k 2]
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


MTP_MODEL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=8, vocab_size=1024, max_position_embeddings=1024,
                 kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
"""--method deepseek_mtp's checkpoint (tests/deepseek_models.BASE for the rest: 8 routed experts, 2 a token)."""


def run_load(server, prompts: list, osl: int, concurrency: int) -> float:
    """Output tokens/s of a closed loop of `concurrency` clients over `prompts` (text or token ids)."""
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
    parser.add_argument("--method", choices=("ngram", "deepseek_mtp"), default="ngram")
    parser.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default 4; deepseek_mtp 1)")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="the config's disable_by_batch_size (default: none, guesses at any batch)")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency and arm")
    args = parser.parse_args()
    from tests.serve_server import ServeProcess

    mtp = args.method == "deepseek_mtp"
    k = args.k or (1 if mtp else 4)
    config = f'{{"method": "{args.method}", "num_speculative_tokens": {k}'
    config += "}" if args.disable_by_batch_size is None else f', "disable_by_batch_size": {args.disable_by_batch_size}}}'
    arms = {"plain": (), "guessing": ("--speculative-config", config)}
    speeds: dict[tuple[str, int], list[float]] = {}
    rates: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        if mtp:
            from tests.deepseek_models import write_deepseek_mtp

            model = write_deepseek_mtp(Path(tmp) / "model", bigram=True, **MTP_MODEL)
        else:
            model = write_model(Path(tmp) / "model")
        for round_index in range(args.rounds):
            order = list(arms) if round_index % 2 == 0 else list(arms)[::-1]
            for arm in order:
                server = ServeProcess(model, "--served-model-name", NAME, *arms[arm])
                try:
                    for concurrency in args.concurrency:
                        rng = random.Random(1000 * round_index + concurrency)  # the same prompts for both arms
                        prompts = [[rng.randrange(MTP_MODEL["vocab_size"]) for _ in range(args.isl)] if mtp
                                   else " ".join(f"w{rng.randrange(1, VOCAB)}" for _ in range(args.isl))
                                   for _ in range(max(args.requests, concurrency))]
                        speed = run_load(server, prompts, args.osl, concurrency)
                        speeds.setdefault((arm, concurrency), []).append(speed)
                        print(f"  round {round_index} {arm} concurrency {concurrency}: {speed:.1f} tokens/s", flush=True)
                    if arm == "guessing":
                        rates.append(server.metrics()["phalanx_spec_decode_acceptance_rate"])
                finally:
                    server.stop()
    what = ("the MTP draft, random DeepSeek-V3 hidden 256 x 4 layers with a draft right by construction" if mtp
            else "prompt lookup, random llama hidden 512 x 4 layers")
    print(f"phalanx serve, {what} (fp32), {config} vs none, greedy, {args.isl} prompt / {args.osl} output tokens, "
          f"median of {args.rounds} alternated rounds")
    print(f"acceptance rate per round: {', '.join(f'{rate:.2f}' for rate in rates)}")
    print(f"{'conc':>4} {'plain tok/s':>12} {'guessing tok/s':>15} {'guessing/plain':>15}")
    for concurrency in args.concurrency:
        plain = statistics.median(speeds[("plain", concurrency)])
        guessing = statistics.median(speeds[("guessing", concurrency)])
        print(f"{concurrency:>4} {plain:>12.1f} {guessing:>15.1f} {guessing / plain:>15.2f}")


if __name__ == "__main__":
    main()
