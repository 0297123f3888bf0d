"""Prefill and decode tokens/s of phalanx generation against `transformers.generate`, on the
same random llama-shaped checkpoint, same machine, same run, greedy.

Both sides are timed the same way, end to end: a generation of 1 new token is the prefill
(one forward over the prompt and the first pick); a generation of N new tokens minus that is
N - 1 decode steps. Arms alternate within each repeat, so a load change on this shared
machine hits both; the median and the best of the repeats are printed, with the ratios.

With `--arch deepseek_v3` the checkpoint is DeepSeek-V3-shaped (multi-head latent attention
at a smaller width, its ratios kept: a 4:1 latent to rotated key, 2:1 plain to rotated query
channels, several heads per latent) and the two arms are phalanx's own: the latent cache
decoded in the absorbed form against the decompressed key/value cache of every head; the KV
bytes per token of each are printed beside their tokens/s; decode is then timed step by step
inside the N-token generation (`Generated.decode_s`).

    .venv/bin/python benchmarks/generate_throughput.py [--device cuda] [--repeats 5]
    .venv/bin/python benchmarks/generate_throughput.py --arch deepseek_v3 [--prompt 512]
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

    if args.arch == "deepseek_v3":
        rope = args.hidden // args.heads  # DeepSeek-V3: 64 rotated of 7168 / 128 heads = 56, about one head's share
        config = transformers.DeepseekV3Config(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.heads, kv_lora_rank=4 * rope, q_lora_rank=6 * rope, qk_rope_head_dim=rope,
            qk_nope_head_dim=2 * rope, v_head_dim=2 * rope, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, max_position_embeddings=1024)
    else:
        config = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
            max_position_embeddings=1024)
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
    parser.add_argument("--arch", choices=("llama", "deepseek_v3"), default="llama",
                        help="llama: phalanx vs transformers; deepseek_v3: latent vs decompressed cache")
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
    from phalanx.inference.decoding import generate_ids
    from phalanx.inference.sampling import Sampling
    from phalanx.cpu_ops.onednn_linear import use_onednn

    device = torch.device(args.device)
    folder = write_model(Path(tempfile.mkdtemp()) / args.arch, args)
    ours = hf.load(folder).to(device)
    use_onednn(ours)  # as `phalanx generate` loads it: oneDNN's GEMM on CPU (cpu_ops/onednn_linear.py)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    theirs.generation_config.eos_token_id = None  # no stopping: both make exactly N tokens
    theirs.generation_config.pad_token_id = 0
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt_tensor = torch.tensor([prompt], device=device)

    last = {}  # phalanx's own step timings of its latest generation

    def phalanx_run(new: int) -> list[int]:
        last["run"] = generate_ids(ours, prompt, max_new_tokens=new, max_len=1024, sampling=Sampling(greedy=True),
                                   device=device)
        return last["run"].new_ids

    def transformers_run(new: int) -> list[int]:
        with torch.no_grad():
            out = theirs.generate(prompt_tensor, do_sample=False, max_new_tokens=new)
        return out[0, args.prompt:].tolist()

    arms = {"phalanx": phalanx_run, "transformers": transformers_run}
    if args.arch == "deepseek_v3":
        arms = {"latent": lambda new: latent_run(new, True), "decompressed": lambda new: latent_run(new, False)}

    def latent_run(new: int, absorbed: bool) -> list[int]:
        from phalanx.model.latent_attention import LatentAttention

        for module in ours.modules():
            if isinstance(module, LatentAttention):
                module.absorbed = absorbed
        return phalanx_run(new)

    for run in arms.values():  # warm-up: first-call allocations and lazy initialization
        run(2)
    times: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in arms}
    outputs = {}
    for _ in range(args.repeats):
        for name, run in arms.items():
            first, _ = timed(lambda: run(1), device)
            whole, outputs[name] = timed(lambda: run(args.new), device)
            times[name]["prefill"].append(args.prompt / first)
            # Both DeepSeek arms are phalanx: its own per-step timing of the N-token run, which a
            # load spike in the separate 1-token run cannot distort.
            decode = last["run"].decode_tokens_per_s if args.arch == "deepseek_v3" else None
            times[name]["decode"].append(decode or (args.new - 1) / max(whole - first, 1e-9))
    first_arm, second_arm = arms
    same = outputs[first_arm] == outputs[second_arm]
    cfg = ours.cfg
    print(f"{args.arch}-shaped hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}; prompt "
          f"{args.prompt}, {args.new} new tokens, greedy, fp32, {device}, {torch.get_num_threads()} threads, "
          f"{args.repeats} repeats; same tokens: {'yes' if same else 'NO'}")
    if args.arch == "deepseek_v3":  # what each cache holds per token, all layers, fp32
        decompressed = cfg.n_layers * cfg.n_heads * (cfg.head_dim + cfg.v_head_dim) * 4
        print(f"  KV bytes per token: latent {cfg.n_layers * cfg.kv_cache_values_per_token * 4}, "
              f"decompressed {decompressed}")
        from phalanx.model.by_name import model_config

        full = model_config("deepseek-v3")
        print(f"  at DeepSeek-V3's shape, values per token and layer: latent {full.kv_cache_values_per_token}, "
              f"decompressed {full.n_heads * (full.head_dim + full.v_head_dim)}")
    for phase in ("prefill", "decode"):
        for name in arms:
            values = times[name][phase]
            print(f"  {phase:7s} {name:12s} median {statistics.median(values):10.0f} tokens/s   best {max(values):10.0f} tokens/s")
        ratio_median = statistics.median(times[first_arm][phase]) / statistics.median(times[second_arm][phase])
        ratio_best = max(times[first_arm][phase]) / max(times[second_arm][phase])
        print(f"  {phase} ratio {first_arm} / {second_arm} = {ratio_median:.2f} (median), {ratio_best:.2f} (best)")
    if not same:
        sys.exit(f"{first_arm} and {second_arm} generated different tokens")


if __name__ == "__main__":
    main()
