"""Full, unsharded weights of a parallelized model, for comparing layouts in tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from phalanx.model.init import canonical_name
from phalanx.parallel.expert import gather_experts


def gathered_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter this rank's model holds, as full CPU tensors keyed by model name.

    DTensor shards (FSDP, tensor parallel) are gathered, so all ranks of a shard group must
    call this together. Pipeline stages each return only their own layers; merge the dicts of
    all stages to get the whole model.
    """
    if dist.is_initialized():
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        state = model.state_dict()
    state = {canonical_name(k): v.detach().float().cpu().clone() for k, v in state.items()}
    if dist.is_initialized():

        state = gather_experts(model, state)  # expert parallelism: each rank holds some experts
    return state
