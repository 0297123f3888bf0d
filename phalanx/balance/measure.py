"""How even a placement is: per-GPU load, balancedness, imbalance, moved slots.

A placement is `phy2log` (layers, slots): the expert each slot holds; GPU g owns slots
`g * slots/gpus .. (g + 1) * slots/gpus - 1`. A replica carries `load / replicas` of its expert.
Balancedness is mean GPU load / max GPU load (SGLang's and vLLM's figure; 1 is perfect);
imbalance is (max - mean) / mean (TensorRT-LLM's; 0 is perfect). A layer with no load counts
as perfectly balanced.
"""

from __future__ import annotations

import numpy as np


def replica_counts(phy2log: np.ndarray, experts: int) -> np.ndarray:
    """Replicas per expert, (layers, experts)."""
    layers = phy2log.shape[0]
    flat = (phy2log + experts * np.arange(layers)[:, None]).ravel()  # one bin range per layer
    return np.bincount(flat, minlength=layers * experts).reshape(layers, experts)


def gpu_loads(load: np.ndarray, phy2log: np.ndarray, gpus: int) -> np.ndarray:
    """Load each GPU carries, (layers, gpus)."""
    count = replica_counts(phy2log, load.shape[1])
    per_replica = np.divide(load, count, out=np.zeros_like(load, dtype=float), where=count > 0)
    slot_load = np.take_along_axis(per_replica, phy2log, axis=1)  # (layers, slots)
    return slot_load.reshape(len(load), gpus, -1).sum(axis=2)


def unreplicated_loads(load: np.ndarray, gpus: int) -> np.ndarray:
    """GPU loads with one replica per expert, in order (expert e on GPU e * gpus // experts), (layers, gpus)."""
    experts = load.shape[1]
    gpu_of_expert = np.arange(experts) * gpus // experts
    loads = np.zeros((len(load), gpus))
    np.add.at(loads, (slice(None), gpu_of_expert), load)
    return loads


def balancedness(loads: np.ndarray) -> np.ndarray:
    """Mean / max per layer of (layers, gpus) loads."""
    top = loads.max(axis=1)
    return np.divide(loads.mean(axis=1), top, out=np.ones(len(loads)), where=top > 0)


def imbalance(loads: np.ndarray) -> np.ndarray:
    """(max - mean) / mean per layer of (layers, gpus) loads."""
    mean = loads.mean(axis=1)
    return np.divide(loads.max(axis=1) - mean, mean, out=np.zeros(len(loads)), where=mean > 0)


def moved_slots(phy2log: np.ndarray, previous: np.ndarray) -> int:
    """Slots whose expert changed: each is one expert's weights copied onto that GPU."""
    return int((phy2log != previous).sum())


def two_replicas_on_one_gpu(phy2log: np.ndarray, gpus: int) -> np.ndarray:
    """Per layer, the number of GPUs that hold some expert twice, (layers,)."""
    per_gpu = np.sort(phy2log.reshape(phy2log.shape[0], gpus, -1), axis=2)
    return (per_gpu[:, :, 1:] == per_gpu[:, :, :-1]).any(axis=2).sum(axis=1)
