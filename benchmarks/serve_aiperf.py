"""A load generator nobody here wrote, NVIDIA's AIPerf (`aiperf profile`), against `phalanx
serve`: the figures a user comparing servers would take, and the batching gain they show.

The model is serve_load.py's llama (hidden 512, 4 layers, fp32) with a word-level tokenizer of
its 2,048 ids saved the way `transformers` saves one, so AIPerf builds its synthetic prompts
and counts tokens with the model's own tokenizer. For each concurrency in `--concurrency`, a
fresh server (a server that ran a load holds its prompts in the prefix cache), then AIPerf's
closed loop of `--requests` streamed completions of `--isl` prompt tokens and exactly `--osl`
output tokens (`ignore_eos`). Prints per concurrency AIPerf's output tokens/s, TTFT and
inter-token latency p50/p99 and the requests it counted failed; checks that every request got
exactly `--osl` tokens and that the server's /metrics counted the same tokens (AIPerf's
measured requests plus its warm-up of one request per concurrent stream). AIPerf counts tokens
from each answer's `usage` (`--use-server-token-count`, which it sets up with
`stream_options.include_usage`): its own count re-tokenizes the answer's text, and this
tokenizer's unknown word `w0` is a special token, which answers leave out of their text (as
vLLM's `skip_special_tokens` does), so a request that generated `w0` would count one short; then the ratio of each concurrency's throughput to the first's, measured in the same
run (the batching gain: what continuous batching buys on this machine).

    .venv/bin/python benchmarks/serve_aiperf.py --aiperf /path/to/venv/bin/aiperf [--concurrency 1 8]

AIPerf is a reference, not a phalanx dependency: a venv of its own
(`python3 -m venv v && v/bin/pip install aiperf`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAME = "llama"
VOCAB = 2048


def write_model(folder: Path, hidden: int = 512, layers: int = 4) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 128, max_position_embeddings=1024,
                                      bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(folder)
    return folder


def run_aiperf(aiperf: str, url: str, model: Path, concurrency: int, args, out: Path) -> dict:
    command = [aiperf, "profile", "--model", NAME, "--url", url, "--endpoint-type", "completions", "--streaming",
               "--tokenizer", str(model), "--prompt-input-tokens-mean", str(args.isl), "--prompt-input-tokens-stddev",
               "0", "--prompt-output-tokens-mean", str(args.osl), "--prompt-output-tokens-stddev", "0",
               "--extra-inputs", "ignore_eos:true", "--concurrency", str(concurrency),
               "--request-count", str(max(args.requests, concurrency)), "--warmup-request-count", str(concurrency),
               "--random-seed", str(getattr(args, "seed", 0)), "--output-artifact-dir", str(out),
               "--no-server-metrics", "--no-gpu-telemetry",
               "--export-outputs-json", "--use-server-token-count"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"aiperf failed at concurrency {concurrency}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads((out / "profile_export_aiperf.json").read_text())


def generation_tokens(server) -> float:
    """The server's count of generated tokens so far (/metrics)."""
    return sum(value for name, value in server.metrics().items()
               if name.split("{")[0] == "phalanx_generation_tokens_total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", required=True, help="the aiperf executable (in a venv of its own)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=24, help="measured requests per concurrency")
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument("--artifacts", default="", help="keep AIPerf's output folders (per request, with texts) here")
    args = parser.parse_args()
    from tests.serve_server import ServeProcess

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model")
        for concurrency in args.concurrency:
            server = ServeProcess(model, "--served-model-name", NAME)
            try:
                before = generation_tokens(server)
                out = Path(args.artifacts or tmp) / f"c{concurrency}"
                figures = run_aiperf(args.aiperf, server.url, model, concurrency, args, out)
                served = generation_tokens(server) - before
            finally:
                server.stop()
            lengths = figures["output_sequence_length"]
            count = int(figures["request_count"]["avg"])
            rows.append({"concurrency": concurrency, "output_tokens_per_s": figures["output_token_throughput"]["avg"],
                         "ttft_ms_p50": figures["time_to_first_token"]["p50"],
                         "ttft_ms_p99": figures["time_to_first_token"]["p99"],
                         "itl_ms_p50": figures["inter_token_latency"]["p50"],
                         "itl_ms_p99": figures["inter_token_latency"]["p99"], "requests": count,
                         "errors": sum(e.get("count", 0) for e in figures.get("error_summary") or []),
                         "every_request_osl": lengths["min"] == lengths["max"] == args.osl,
                         "server_tokens": served, "aiperf_tokens": lengths["sum"] + concurrency * args.osl})
            print(f"  concurrency {concurrency} done", file=sys.stderr, flush=True)
    print(f"AIPerf against phalanx serve: {args.isl} prompt tokens, {args.osl} output tokens (ignore_eos), streamed")
    print("conc  out tok/s  TTFT p50/p99 ms   ITL p50/p99 ms  requests errors  all osl  tokens server/aiperf")
    for row in rows:
        print(f"{row['concurrency']:4d} {row['output_tokens_per_s']:10.1f}  {row['ttft_ms_p50']:7.1f}/{row['ttft_ms_p99']:7.1f}"
              f"  {row['itl_ms_p50']:6.1f}/{row['itl_ms_p99']:6.1f}  {row['requests']:8d} {row['errors']:6d}"
              f"  {str(row['every_request_osl']):>7}  {row['server_tokens']:.0f}/{row['aiperf_tokens']:.0f}")
    base = rows[0]
    for row in rows[1:]:
        print(f"throughput at concurrency {row['concurrency']} / at {base['concurrency']}: "
              f"{row['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
