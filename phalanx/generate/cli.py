"""`phalanx generate`: text from a Hugging Face model directory or a training run, with a KV
cache, in one process or in a tensor-parallel layout over local workers.

Importing this module does not import torch (the CLI starts without it); the command does.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from phalanx.errors import UserError
from phalanx.plan import plan_from_string
from phalanx.plan_model_checks import validate_for_model
from phalanx.process_count import check_process_count

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 1.0}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text from a model directory or a run",
        description="Prefill the prompt once, then one token per step through a KV cache. Stops after "
                    "--max-new-tokens or the tokenizer's end-of-text token.")
    parser.add_argument("--model", required=True, help="Hugging Face model directory (with weights), or a run directory of phalanx train")
    parser.add_argument("--step", type=int, default=None, help="with a run directory: the checkpoint of this step (default: the newest)")
    parser.add_argument("--prompt", default=None, help="prompt text")
    parser.add_argument("--prompt-ids", default=None, help="prompt as token ids, e.g. 1,2,3 (no tokenizer needed)")
    parser.add_argument("--tokenizer", default="", help="tokenizer.json or 'bytes' (default: the model directory's tokenizer.json, else bytes)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most new tokens (default 64)")
    parser.add_argument("--greedy", action="store_true", help="always the most likely token (the first maximum)")
    parser.add_argument("--temperature", type=float, default=None, help=f"sampling temperature (default {DEFAULTS['temperature']})")
    parser.add_argument("--top-k", type=int, default=None, help=f"draw among the k most likely tokens, 0: all (default {DEFAULTS['top_k']})")
    parser.add_argument("--top-p", type=float, default=None, help=f"then among the most likely whose probabilities add up to p (default {DEFAULTS['top_p']})")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--nproc", type=int, default=1, help="local worker processes (default 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads per process (default 0: OMP_NUM_THREADS if set, else the cores this process may use divided among the local processes; docs/serve.md)")
    parser.add_argument("--plan", default="", help="parallel layout, e.g. tp=2 (default: tp over all processes)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--json", action="store_true", help='print {"new_ids", "text", "prefill_s", "decode_tokens_per_s"}')
    parser.add_argument("--rdzv-endpoint", default="", help="host:port of the rendezvous (default: 127.0.0.1 and a free port)")
    parser.set_defaults(func=_run)


def parse_prompt_ids(text: str) -> list[int]:
    parts = text.split(",")
    if not text.strip():
        raise UserError("--prompt-ids is empty")
    if any(not part.strip() for part in parts):  # "1,,2" or "1,2,": a lost id, not a separator to skip
        raise UserError(f"--prompt-ids takes comma-separated token ids like 1,2,3, got {text!r} (an empty id)")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise UserError(f"--prompt-ids takes comma-separated token ids like 1,2,3, got {text!r}") from None


def sampling_fields(args) -> dict:
    chosen = {name: getattr(args, name) for name in DEFAULTS if getattr(args, name) is not None}
    if args.greedy and chosen:
        flags = ", ".join("--" + name.replace("_", "-") for name in chosen)
        raise UserError(f"--greedy takes the most likely token; it cannot be combined with {flags}")
    return {"greedy": args.greedy, **DEFAULTS, **chosen, "seed": args.seed}


def prepare_job(args) -> dict:
    """Everything checked before any weights are read or workers started, as plain data."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.inference.decoding import check_context
    from phalanx.inference.model_source import resolve_model, text_codec
    from phalanx.inference.sampling import Sampling

    if (args.prompt is None) == (args.prompt_ids is None):
        raise UserError("give exactly one of --prompt TEXT and --prompt-ids 1,2,3")
    sampling = Sampling(**sampling_fields(args)).validate()
    if args.nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {args.nproc}")

    check_process_count(args.nproc)
    source = resolve_model(args.model, args.step)
    codec = text_codec(source.tokenizer_dir, args.tokenizer or source.tokenizer)
    prompt = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else codec.encode(args.prompt)
    vocab = source.cfg.vocab_size
    outside = [i for i in prompt if not 0 <= i < vocab]
    if outside:
        raise UserError(f"prompt token id {outside[0]} is outside the model's vocabulary (0 to {vocab - 1})")
    check_context(len(prompt), args.max_new_tokens, source.cfg.max_seq_len)
    world_size = int(os.environ.get("WORLD_SIZE", args.nproc))
    plan = plan_from_string(args.plan or f"tp={world_size}", world_size)
    if plan.cp > 1:  # one sequence at a time, decoded a token per step: nothing to split
        raise UserError(f"phalanx generate does not run context parallelism (plan {plan.to_string()}); "
                        "use tp=N, or generate on one process")
    if plan.world_size != plan.tp:  # dp would only repeat the work; pp and ep: not built yet
        raise UserError(f"phalanx generate runs tensor-parallel layouts (tp=N, optionally sp=true); "
                        f"plan {plan.to_string()} has dp={plan.dp}, pp={plan.pp}")

    # Sequence parallelism splits the context over the tp ranks; decoding pads it on the right
    # to a multiple of tp (decoding.py), so the length checked is the padded one.
    padded = -(-len(prompt) // plan.tp) * plan.tp if plan.sp else len(prompt)
    validate_for_model(plan, source.cfg, global_batch=plan.dp * plan.num_microbatches, seq_len=padded)
    # The checkpoint found (checked once here): every rank reads that one, without re-choosing.
    step = source.step if source.is_run else args.step
    return {"model": args.model, "step": step, "tokenizer": args.tokenizer, "prompt": prompt,
            "max_new_tokens": args.max_new_tokens, "sampling": asdict(sampling), "plan": plan.to_string(),
            "device": args.device, "json": args.json, "threads": args.threads}


def run_job(job: dict):
    """On every rank: load this rank's part of the model and generate. Returns (Generated, codec)."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.cpu_ops.onednn_linear import use_onednn
    from phalanx.inference.decoding import generate_ids
    from phalanx.inference.model_source import load_model, resolve_model, text_codec
    from phalanx.inference.sampling import Sampling
    from phalanx.local_device import pick_device
    from phalanx.parallel.mesh import build_mesh
    from phalanx.worker_group import say_threads

    source = resolve_model(job["model"], job["step"])
    codec = text_codec(source.tokenizer_dir, job["tokenizer"] or source.tokenizer)
    device = pick_device(job["device"])
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    mesh = build_mesh(plan_from_string(job["plan"], world_size), device)
    model = load_model(source, mesh)
    use_onednn(model)  # on CPU: oneDNN's GEMM for the plain matrices (cpu_ops/onednn_linear.py)
    say_threads(job.get("threads", 0))  # once the model is in: a failed start stays one error line
    result = generate_ids(model, job["prompt"], max_new_tokens=job["max_new_tokens"], max_len=source.cfg.max_seq_len,
                          sampling=Sampling(**job["sampling"]), device=device, eos_id=codec.eos_id,
                          pad_to=mesh.plan.tp if mesh.plan.sp else 1)
    return result, codec


def output(result, codec, as_json: bool) -> str:
    text = codec.decode(result.new_ids)
    if as_json:
        return json.dumps({"new_ids": result.new_ids, "text": text, "prefill_s": result.prefill_s,
                           "decode_tokens_per_s": result.decode_tokens_per_s})
    return text


def worker_main(job: dict) -> int:
    """Entry point of every worker; rank 0 prints."""
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.worker_group import run_in_group

    rank = int(os.environ.get("RANK", "0"))
    done = run_in_group(job["device"], lambda: run_job(job), threads=job.get("threads", 0), say=False)
    if done is None:
        return 2
    result, codec = done
    if rank == 0:
        print(output(result, codec, job["json"]), flush=True)
    return 0


def _run(args) -> int:
    job = prepare_job(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # already a worker of torchrun
        return worker_main(job)
    if args.nproc == 1:
        return worker_main(job)
    # Imported when run, not at the top: it brings in torch, which start-up need not wait for.
    from phalanx.worker_group import check_nproc
    from phalanx.launch.worker_launch import launch_workers

    check_nproc(args.nproc, args.device)
    # The one launcher of every command, with no restarts (a generation is short: run it again).
    return launch_workers(worker_main, lambda attempt: (job,), args.nproc, args.device, 0, flag=None,
                          rdzv_endpoint=args.rdzv_endpoint)
