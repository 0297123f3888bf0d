"""Serving's tensor parallelism (`parallel.tp_inference`): the blocks' matrices as local shards
give the logits the DTensor model gives, and both those of one process.

Tolerance: against the DTensor model of the same ranks, 1e-6 (the same local products and
the same all-reduce; measured equal); against one process, 1e-5 (the row-parallel matrices'
partial products summed across ranks instead of one dot product, as tests/test_hybrid_layouts.py
explains). Several token counts, since serving meets a new one nearly every step.
"""

from __future__ import annotations

import torch

from phalanx.model.by_name import model_config
from phalanx.testing.fork_ranks import run_ranks

SHAPES = [(1, 5), (1, 17), (3, 9)]


def _logits(model, cfg) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for index, shape in enumerate(SHAPES):
            tokens = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(index))
            logits = model(tokens)
            out.append((logits.full_tensor() if hasattr(logits, "full_tensor") else logits).float())
    return out


def _before_and_after(model_name: str):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.parallel.tp_inference import localize_block_matrices
    from phalanx.plan import plan_from_string

    cfg = model_config(model_name)
    mesh = build_mesh(plan_from_string(f"tp={dist.get_world_size()}", dist.get_world_size()), torch.device("cpu"))
    model = parallelize(cfg, mesh, seed=0).eval()
    before = _logits(model, cfg)
    converted = localize_block_matrices(model, mesh.group("tp"))
    still_dtensor = sorted(name for name, p in model.named_parameters() if isinstance(p, DTensor))
    return before, _logits(model, cfg), converted, still_dtensor


def _one_process(model_name: str):
    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import plan_from_string

    cfg = model_config(model_name)
    return _logits(parallelize(cfg, build_mesh(plan_from_string("", 1), torch.device("cpu")), seed=0).eval(), cfg)


def test_local_shards_give_the_dtensor_and_the_one_process_logits():
    cfg = model_config("tiny")
    reference = run_ranks(1, _one_process, "tiny")[0]
    for before, after, converted, still_dtensor in run_ranks(2, _before_and_after, "tiny"):
        assert converted == 7 * cfg.n_layers  # wq, wk, wv, wo, w1, w2, w3 of every block
        # Only the vocabulary-parallel embedding and output stay DTensors (tied: one parameter).
        assert all(not name.startswith("layers.") for name in still_dtensor) and still_dtensor, still_dtensor
        for dtensor_logits, local_logits, one in zip(before, after, reference):
            torch.testing.assert_close(local_logits, dtensor_logits, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(local_logits, one, atol=1e-5, rtol=1e-5)


def test_a_matrix_with_its_own_hook_keeps_its_dtensor():
    """A hook that `parallelize_module` did not register (sequence parallelism's gather, a
    user's) means the module is not the default style: it is left as it was."""
    import torch.distributed as dist

    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.parallel.tp_inference import localize_block_matrices
    from phalanx.plan import plan_from_string

    def check():
        from torch.distributed.tensor import DTensor

        cfg = model_config("tiny")
        mesh = build_mesh(plan_from_string("tp=2", dist.get_world_size()), torch.device("cpu"))
        model = parallelize(cfg, mesh, seed=0).eval()
        model.layers["0"].attention.wq.register_forward_hook(lambda module, inputs, output: output)
        converted = localize_block_matrices(model, mesh.group("tp"))
        return converted, isinstance(model.layers["0"].attention.wq.weight, DTensor)

    for converted, kept in run_ranks(2, check):
        assert kept and converted == 7 * model_config("tiny").n_layers - 1
