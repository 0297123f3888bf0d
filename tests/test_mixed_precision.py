"""`--dtype bf16` is mixed precision: bf16 compute weights over fp32 masters and moments.

- The saved activations are bf16 and each linear saves its own input (the norm's output that
  q, k and v share), not a bf16 copy cast from an fp32 residual stream as autocast over fp32
  weights does; the probe is also run on that older mode (`param_dtype=fp32`), so it is shown
  to tell them apart.
- The masters, their gradients, AdamW's moments and the checkpoint are fp32, and a bf16 run
  resumes exactly where it stopped (the copies are made again from the restored masters).
- Every layout equals one bf16 process within phalanx/testing/bf16_bounds.py (reasons there):
  DDP, FSDP2 zero=3, tp=2 with sp (and selective recompute), pp=2 (and full recompute) and
  tiny-moe's dp=2,ep=2.
  `PYTHONPATH=. python tests/test_mixed_precision.py` prints the measured differences.
- A torch.compile'd block traces its casts in one graph (for `--compile`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from phalanx.testing.bf16_bounds import BF16_LOSS, BF16_WEIGHT_MEAN, bf16_grad_norm_bound
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.weights import gathered_weights
from phalanx.train.loop import train

# Recompute rides along with tp and pp: the checkpointed blocks reuse the step's compute copies.
LAYOUTS = ["tiny dp=2", "tiny dp=2,zero=3", "tiny tp=2,sp=true,recompute=selective", "tiny pp=2,recompute=full",
           "tiny-moe dp=2,ep=2"]


def test_bf16_weights_under_fp32_is_a_one_line_error(tmp_path, capsys):
    from phalanx.testing.cli_errors import assert_cli_error

    argv = ["train", "--model", "tiny", "--steps", "1", "--plan", "param_dtype=bf16", "--dtype", "fp32",
            "--out", str(tmp_path / "r")]
    assert_cli_error(argv, capsys, "param_dtype=bf16 with --dtype fp32 would compute in bf16; use --dtype bf16")


def _one_process_model(plan_text: str, model: str = "tiny"):
    from phalanx.model.by_name import model_config
    from phalanx.parallel.apply import parallelize
    from phalanx.plan_model_checks import validate_for_model
    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import plan_from_string

    cfg = model_config(model)
    plan = validate_for_model(plan_from_string(plan_text, 1), cfg, global_batch=2, seq_len=16, dtype="bf16")
    mesh = build_mesh(plan, torch.device("cpu"))
    return parallelize(cfg, mesh, seed=0), plan, cfg


def _linear_inputs_saved(plan_text: str) -> tuple[set, set, set]:
    """One bf16 forward and backward: (dtypes of the linears' inputs, names of linears whose
    input is not among the saved tensors, dtypes of the blocks' outputs)."""
    from phalanx.parallel.mixed_precision import autocast_for
    from phalanx.train.loop import batch_loss

    model, plan, cfg = _one_process_model(plan_text)
    inputs, saved = {}, set()
    blocks: set = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0]))
    for block in model.layers.values():
        block.register_forward_hook(lambda m, args, out: blocks.add(out.dtype))

    def pack(tensor):
        saved.add(tensor.untyped_storage().data_ptr())
        return tensor

    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = batch_loss(model, tokens[:, :-1], tokens[:, 1:], autocast_for(plan, "bf16", torch.device("cpu")))
    loss.backward()
    unsaved = {name for name, x in inputs.items() if x.untyped_storage().data_ptr() not in saved}
    return {x.dtype for x in inputs.values()}, unsaved, blocks


def test_linears_save_their_own_bf16_input():
    dtypes, unsaved, residual = _linear_inputs_saved("")
    assert dtypes == {torch.bfloat16} and residual == {torch.bfloat16}
    assert not unsaved  # no linear saved a cast copy of its input instead of the input
    # The older mode, autocast over fp32 weights, fails each of these checks.
    dtypes, unsaved, residual = _linear_inputs_saved("param_dtype=fp32")
    assert torch.float32 in dtypes and residual == {torch.float32}  # the norms' outputs
    assert unsaved and all(name.endswith(("wq", "wk", "wv", "w1", "w3", "output")) for name in unsaved), unsaved


def test_masters_gradients_and_moments_stay_fp32():
    from phalanx.parallel.mixed_precision import autocast_for
    from phalanx.train.config import TrainConfig
    from phalanx.train.loop import batch_loss, make_optimizer

    model, plan, cfg = _one_process_model("", "tiny-moe")
    optimizer = make_optimizer(model, TrainConfig())
    seen = []  # the weight wq's forward computes with (this hook runs after the casting one)
    model.layers["0"].attention.wq.register_forward_pre_hook(lambda m, args: seen.append(m.weight))
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # two micro-batches
        batch_loss(model, tokens[:, :-1], tokens[:, 1:], autocast_for(plan, "bf16", torch.device("cpu"))).backward()
    assert seen[0].dtype == torch.bfloat16 and seen[0] is seen[1]  # one copy per step, not per micro-batch
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {p.grad.dtype for p in params.values()} == {torch.float32}
    before = {name: p.detach().clone() for name, p in params.items()}
    optimizer.step()
    state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    assert len(state) == 2 * len(params) and {v.dtype for v in state} == {torch.float32}
    assert all(not torch.equal(before[name], p) for name, p in params.items())  # every master moved
    # The next forward computes with copies of the updated masters, not the step's old ones.
    loss = batch_loss(model, tokens[:, :-1], tokens[:, 1:], autocast_for(plan, "bf16", torch.device("cpu")))
    assert seen[2] is not seen[1]
    with torch.no_grad():  # the masters changed in place, as a checkpoint load changes them
        for name, p in params.items():
            p.copy_(before[name])
    again = batch_loss(model, tokens[:, :-1], tokens[:, 1:], autocast_for(plan, "bf16", torch.device("cpu")))
    assert float(loss.detach()) != float(again.detach())


def test_a_compiled_block_traces_its_casts_in_one_graph():
    """Inside torch.compile the compute copies are cast in the graph, uncached: one frame, no
    graph break or recompile over three forward-backward passes (backend "eager": dynamo only)."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    model, _, cfg = _one_process_model("")
    block = model.layers["0"]
    x = torch.randn(2, 16, cfg.dim, dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounter()
    compiled = torch.compile(block, backend=backend)
    for _ in range(3):
        out = compiled(x, model.rope)
        out.float().sum().backward()
    assert backend.frame_count == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert out.dtype == torch.bfloat16 and {p.grad.dtype for p in block.parameters()} == {torch.float32}
    torch._dynamo.reset()


def _losses_and_weights(cfg):
    result = train(cfg, Path(cfg.out))
    return result.losses, {name: value.detach().clone() for name, value in result.model.state_dict().items()}


def test_bf16_resume_is_exact_and_checkpoints_hold_fp32(tiny_config):
    from torch.distributed.checkpoint import FileSystemReader

    from phalanx.checkpoint.store import latest_checkpoint

    cfg = tiny_config.replace(steps=4, ckpt_every=2, dtype="bf16")
    full, full_weights = run_ranks(1, _losses_and_weights, cfg)[0]
    for path in (Path(cfg.out) / "checkpoints").glob("step_*"):
        if json.loads((path / "phalanx.json").read_text())["step"] > 2:  # as if stopped after step 2
            shutil.rmtree(path)
    step, path = latest_checkpoint(Path(cfg.out))
    assert step == 2
    dtypes = {meta.properties.dtype for name, meta in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
              if hasattr(meta, "properties") and meta.size.numel() > 1}
    assert dtypes == {torch.float32}  # the weights and both moments: no bf16 copy was saved
    resumed, weights = run_ranks(1, _losses_and_weights, cfg.replace(resume=True))[0]
    assert resumed == full[2:]
    assert all(torch.equal(weights[name], value) for name, value in full_weights.items())


def _dir(cfg, layout: str) -> Path:
    return Path(cfg.out) / layout.replace(" ", "_").replace(",", "_").replace("=", "-")


def _train_layouts(cfg, layouts: list[str]) -> dict:
    out = {}
    for layout in layouts:
        model, plan = layout.split(" ")
        result = train(cfg.replace(model=model, plan=plan, out=str(_dir(cfg, layout))), _dir(cfg, layout))
        out[layout] = (result.losses, gathered_weights(result.model))
    return out


def _grad_norms(cfg, layout: str) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (_dir(cfg, layout) / "metrics.jsonl").read_text().splitlines()]


def _train_all(out: str) -> tuple:
    """The config, the one-process references and every rank's results of LAYOUTS, in bf16."""
    from phalanx.testing.small_corpus import ONE_FILE_CORPUS
    from phalanx.train.config import TrainConfig

    cfg = TrainConfig(model="tiny", data=ONE_FILE_CORPUS, steps=4, global_batch=8, seq_len=32, lr=3e-3, warmup_steps=1,
                      eval_every=0, ckpt_every=0, sample_tokens=0, progress=False, plot=False, device="cpu", dtype="bf16", out=out)
    reference = run_ranks(1, _train_layouts, cfg, ["tiny ", "tiny-moe "])[0]
    return cfg, reference, run_ranks(2, _train_layouts, cfg, LAYOUTS, timeout_s=600)


def _differences(runs, layout: str) -> dict:
    """A layout against its one-process run: the largest loss difference and mean absolute
    weight difference over ranks, and the relative gradient-norm difference per step."""
    cfg, reference, ranks = runs
    model = layout.split(" ")[0]
    ref_losses, ref_weights = reference[f"{model} "]
    losses, weights = [], []
    for rank in ranks:  # every rank's copy (pipeline stages: their own layers)
        rank_losses, rank_weights = rank[layout]
        assert rank_weights and rank_weights.keys() <= ref_weights.keys()
        losses.append(max(abs(a - b) for a, b in zip(rank_losses, ref_losses)))
        total = sum(float((w - ref_weights[k]).abs().sum()) for k, w in rank_weights.items())
        weights.append(total / sum(w.numel() for w in rank_weights.values()))
    norms = [abs(a - b) / b for a, b in zip(_grad_norms(cfg, layout), _grad_norms(cfg, f"{model} "))]
    return {"loss": max(losses), "weight_mean": max(weights), "grad_norm": norms}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _train_all(str(tmp_path_factory.mktemp("bf16")))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_bf16_process(runs, layout):
    measured = _differences(runs, layout)
    assert measured["loss"] < BF16_LOSS and measured["weight_mean"] < BF16_WEIGHT_MEAN, measured
    assert len(measured["grad_norm"]) == 4, measured
    assert all(norm < bf16_grad_norm_bound(step) for step, norm in enumerate(measured["grad_norm"], 1)), measured


if __name__ == "__main__":  # the measured differences that phalanx/testing/bf16_bounds.py quotes
    import tempfile

    from phalanx.testing.fork_ranks import preload_rank_imports

    preload_rank_imports()
    with tempfile.TemporaryDirectory() as folder:
        results = _train_all(folder)
        for layout in LAYOUTS:
            d = _differences(results, layout)
            print(f"{layout:38s} loss {d['loss']:.1e}  grad norm step 1 {d['grad_norm'][0]:.2%}, later "
                  f"<= {max(d['grad_norm'][1:]):.2%}  weights mean {d['weight_mean']:.1e}")
