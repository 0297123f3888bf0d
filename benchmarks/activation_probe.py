"""What autograd saves for backward in phalanx's model, tensor by tensor, against the planner's formula.

    PYTHONPATH=. python benchmarks/activation_probe.py                     # small, batch 8, seq 128, CPU
    PYTHONPATH=. python benchmarks/activation_probe.py --model tiny-moe --device cuda --dtype bf16

One training forward of the whole model and the loss (as `phalanx train` computes it) runs
under `torch.autograd.graph.saved_tensors_hooks`; every saved tensor is listed once per
storage (a view saved twice costs once), with the module that was running when it was saved
and its size in units of s x b x h elements. Weights and buffers (the rotary table) are not
activations and are left out. The per-layer total is compared with
`memory.layer_activation_bytes` under the options the trainer runs with on this device
(`Options.phalanx_trainer`; its RMSNorm saves input and rstd on every device), and the rest (final norm, output
projection, loss) with the head term of peak_memory.py. This is how the memory model's
per-tensor terms were found; planner_memory.py checks the whole step.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from phalanx.model.by_name import model_config
from phalanx.model.transformer import Transformer
from phalanx.planner.memory import TRAINER_PRECISION, layer_activation_bytes
from phalanx.train.pipeline_step import token_loss


def saved_tensors(model: Transformer, tokens: torch.Tensor, autocast) -> dict[int, tuple[str, tuple, torch.dtype, int]]:
    """storage -> (module, shape, dtype, bytes) of every tensor saved for backward, first saver."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    running: list[str] = ["loss"]
    for name, module in model.named_modules():
        if name and name.count(".") <= 2:  # blocks' parts (layers.0.attention), not their linears
            module.register_forward_pre_hook(lambda m, a, name=name: running.append(name) and None)
            module.register_forward_hook(lambda m, a, o: running.pop() and None)  # None: output unchanged
    seen: dict[int, tuple[str, tuple, torch.dtype, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (running[-1], tuple(t.shape), t.dtype, storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        logits = model(tokens[:, :-1])
        loss = token_loss(logits, tokens[:, 1:])
    loss.backward()
    return seen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: autocast (over fp32 weights: `phalanx train --dtype bf16 --plan param_dtype=fp32`)")
    parser.add_argument("--weights", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: the weights themselves in bf16, as `--dtype bf16` computes (FSDP2's or the trainer's copies)")
    args = parser.parse_args(argv)
    cfg = model_config(args.model)
    torch.manual_seed(0)
    model = Transformer(cfg).to(args.device, dtype=torch.bfloat16 if args.weights == "bf16" else torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=args.device)
    autocast = ((lambda: torch.autocast(args.device, dtype=torch.bfloat16)) if args.dtype == "bf16"
                else contextlib.nullcontext)
    seen = saved_tensors(model, tokens, autocast)
    sbh = args.seq * args.batch * cfg.dim
    first = "layers.0"
    per_layer, head = 0, 0
    print(f"{args.model}, batch {args.batch}, seq {args.seq}, {args.device} {args.dtype}: tensors saved by {first}")
    for where, shape, dtype, nbytes in seen.values():
        if where == first or where.startswith(first + "."):
            per_layer += nbytes
            print(f"  {where:32s} {str(shape):22s} {str(dtype):15s} {nbytes / sbh:6.3f} bytes per s*b*h element")
        elif not where.startswith("layers."):
            head += nbytes
            print(f"  {where:32s} {str(shape):22s} {str(dtype):15s} {nbytes / sbh:6.3f} (head and loss)")
    precision = TRAINER_PRECISION[args.dtype]
    autocast_fp32 = args.dtype == "bf16" and args.weights == "fp32"  # the trainer with param_dtype=fp32
    wide = autocast_fp32  # fp32 norm tensors: their input is the fp32 residual stream
    element = precision.activation  # the formula counts 16-bit elements
    formula = element / 2 * layer_activation_bytes(
        cfg, seq=args.seq, mbs=args.batch, tp=1, sp=False, recompute="none", moe=cfg.is_moe_layer(0),
        phalanx_model=True, autocast_fp32=autocast_fp32,
        wide_norms=wide)
    # the final norm's input and rstd, the output projection's input, the loss's logits
    head_formula = (((4 if wide else element) + element) * sbh + 4 * args.batch * args.seq
                    + args.batch * args.seq * cfg.vocab_size * precision.logit)
    if autocast_fp32:  # autocast's cached 16-bit copies of the weights, one layer's and the output's
        from phalanx.planner.memory import param_counts

        counts = param_counts(cfg)
        layer = counts.attention + counts.norms + (counts.experts + counts.moe_other if cfg.is_moe_layer(0)
                                                   else counts.dense_mlp)
        formula += precision.gathered * (layer - counts.norms)  # the norms' weights are not cast
        head_formula += precision.gathered * counts.embedding
    print(f"{first}: saved {per_layer / 2**20:.2f} MiB, formula {formula / 2**20:.2f} MiB ({formula / per_layer - 1:+.1%})")
    print(f"head and loss: saved {head / 2**20:.2f} MiB, formula {head_formula / 2**20:.2f} MiB "
          f"({head_formula / head - 1:+.1%})")


if __name__ == "__main__":
    main()
