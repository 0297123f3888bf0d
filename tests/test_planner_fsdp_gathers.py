"""What the planner charges ZeRO-3 for recompute, counted on the trainer's own FSDP2 model:
the parameter all-gathers of one training step with and without full recompute."""

import torch

from phalanx.model.by_name import model_config
from phalanx.plan import Plan
from phalanx.testing.fork_ranks import run_ranks


def _gathers_per_step(recompute: str) -> int:
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh

    cfg = model_config("tiny")
    model = parallelize(cfg, build_mesh(Plan(dp=2, fsdp=True, recompute=recompute), torch.device("cpu")), seed=0)
    calls = []
    original = param_group.foreach_all_gather

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    param_group.foreach_all_gather = counted
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    for _ in range(2):  # the second step is the steady state
        calls.clear()
        model(tokens).float().sum().backward()
    return len(calls)


def test_recompute_inside_an_fsdp_unit_gathers_nothing_more():
    # Each unit is gathered forward and again backward (resharded after forward): per block the
    # block itself, its attention and each MLP linear (data_parallel.sub_block_units), and the
    # root: 2 (4 x 5 + 1) = 42 for the tiny model's 4 SwiGLU blocks. The checkpointed block re-runs its
    # forward inside its unit's backward, after that gather, so recompute adds no all-gather:
    # the planner's Options.recompute_regathers=False.
    none = run_ranks(2, _gathers_per_step, "none")
    full = run_ranks(2, _gathers_per_step, "full")
    cfg = model_config("tiny")
    per_block = 1 + 1 + (3 if cfg.mlp == "swiglu" else 2)
    assert none == [2 * (cfg.n_layers * per_block + 1)] * 2
    assert full == none
