"""Prefill and decode tokens/s of phalanx generation against `transformers.generate`, on the
same random llama-shaped checkpoint, same machine, same run, greedy.

Both sides are timed the same way, end to end: a generation of 1 new token is the prefill
(one forward over the prompt and the first pick); a generation of N new tokens minus that is
N - 1 decode steps. Arms alternate within each repeat, so a load change on this shared
machine hits both; the median and the best of the repeats are printed, with the ratios.

    .venv/bin/python benchmarks/generate_throughput.py [--device cuda] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_model(folder: Path, args) -> Path:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads // 2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # O(1) logits, so greedy picks are not near-ties
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return folder


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> tuple[float, list[int]]:
    sync(device)
    began = time.perf_counter()
    ids = fn()
    sync(device)
    return time.perf_counter() - began, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for both (default 1: on a shared machine, more threads mostly wait on each other)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    import phalanx.hf as hf
    from phalanx.generate.decoding import generate_ids
    from phalanx.generate.sampling import Sampling

    device = torch.device(args.device)
    folder = write_model(Path(tempfile.mkdtemp()) / "llama", args)
    ours = hf.load(folder).to(device)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    theirs.generation_config.eos_token_id = None  # no stopping: both make exactly N tokens
    theirs.generation_config.pad_token_id = 0
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt_tensor = torch.tensor([prompt], device=device)

    def phalanx_run(new: int) -> list[int]:
        return generate_ids(ours, prompt, max_new_tokens=new, max_len=1024, sampling=Sampling(greedy=True),
                            device=device).new_ids

    def transformers_run(new: int) -> list[int]:
        with torch.no_grad():
            out = theirs.generate(prompt_tensor, do_sample=False, max_new_tokens=new)
        return out[0, args.prompt:].tolist()

    arms = {"phalanx": phalanx_run, "transformers": transformers_run}
    for run in arms.values():  # warm-up: first-call allocations and lazy initialization
        run(2)
    times: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in arms}
    outputs = {}
    for _ in range(args.repeats):
        for name, run in arms.items():
            first, _ = timed(lambda: run(1), device)
            whole, outputs[name] = timed(lambda: run(args.new), device)
            times[name]["prefill"].append(args.prompt / first)
            times[name]["decode"].append((args.new - 1) / max(whole - first, 1e-9))
    same = outputs["phalanx"] == outputs["transformers"]
    print(f"llama-shaped hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}; prompt "
          f"{args.prompt}, {args.new} new tokens, greedy, fp32, {device}, {torch.get_num_threads()} threads, "
          f"{args.repeats} repeats; same tokens: {'yes' if same else 'NO'}")
    for phase in ("prefill", "decode"):
        for name in arms:
            values = times[name][phase]
            print(f"  {phase:7s} {name:12s} median {statistics.median(values):10.0f} tokens/s   best {max(values):10.0f} tokens/s")
        ratio_median = statistics.median(times["phalanx"][phase]) / statistics.median(times["transformers"][phase])
        ratio_best = max(times["phalanx"][phase]) / max(times["transformers"][phase])
        print(f"  {phase} ratio phalanx / transformers = {ratio_median:.2f} (median), {ratio_best:.2f} (best)")
    if not same:
        sys.exit("phalanx and transformers generated different tokens")


if __name__ == "__main__":
    main()
