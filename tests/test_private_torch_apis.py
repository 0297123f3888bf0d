"""The private PyTorch APIs that phalanx/parallel/ uses exist in the installed torch.

phalanx supports torch 2.11 and later; private APIs can move between releases without notice,
so CI on each supported torch (2.11 on the GPU runners) fails here, naming the API, rather than
deep inside a multi-rank run. The list is the one in phalanx/parallel/mixed_precision.py's docstring.
"""

from __future__ import annotations

import importlib

import pytest

torch = pytest.importorskip("torch")

# (module, attribute path, who uses it)
PRIVATE_APIS = [
    ("torch", "_foreach_norm", "parallel/grad_norm.py"),
    ("torch", "_foreach_mul_", "parallel/grad_norm.py"),
    ("torch", "_C._autograd._top_saved_tensors_default_hooks", "parallel/sequence_parallel.py"),
    ("torch.distributed._functional_collectives", "AsyncCollectiveTensor", "parallel/compile.py, sequence_parallel.py"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper", "parallel/recompute.py"),
    ("torch.distributed.tensor.placement_types", "_StridedShard", "parallel/materialize.py"),
]


@pytest.mark.parametrize("module, path, user", PRIVATE_APIS, ids=[f"{m}.{p}" for m, p, _ in PRIVATE_APIS])
def test_private_api_exists(module, path, user):
    value = importlib.import_module(module)
    for name in path.split("."):
        assert hasattr(value, name), f"{module}.{path} (used by {user}) is missing in torch {torch.__version__}"
        value = getattr(value, name)
    assert callable(value)
