"""The group-to-node assignments with the lightest most loaded node, by enumeration.

A greedy assignment (heaviest group first into the lightest node) can miss the split that
balances nodes best, and no packing within a node mends a node that carries too much: its GPUs
share its load. Where the assignments are few enough (nodes ** (groups - 1), group 0 fixed on
node 0 since nodes are interchangeable), every one within the group bounds is scored by its
most loaded node, across all layers at once, and the `keep` lightest are returned as candidates.
"""

from __future__ import annotations

import numpy as np

MOST_ASSIGNMENTS = 1 << 18
"""Layers x assignments enumerated at most (the score is one (layers, assignments, nodes) array)."""


def lightest_assignments(group_load: np.ndarray, nodes: int, low: int, high: int, keep: int) -> np.ndarray | None:
    """(layers, keep, groups): node of each group in each layer's `keep` best assignments, or None
    where there are too many to enumerate. Nodes hold `low` to `high` groups each."""
    layers, groups = group_load.shape
    total = nodes ** (groups - 1)
    if layers * total > MOST_ASSIGNMENTS:
        return None
    digits = (np.arange(total)[:, None] // nodes ** np.arange(groups - 1)) % nodes  # (assignments, groups - 1)
    node_of = np.concatenate([np.zeros((total, 1), dtype=np.int64), digits], axis=1)  # (assignments, groups)
    member = node_of[:, :, None] == np.arange(nodes)  # (assignments, groups, nodes)
    sizes = member.sum(axis=1)
    node_of, member = node_of[((sizes >= low) & (sizes <= high)).all(axis=1)], member[((sizes >= low) & (sizes <= high)).all(axis=1)]
    keep = min(keep, len(node_of))
    top = np.einsum("lg,agn->lan", group_load, member.astype(group_load.dtype)).max(axis=2)  # (layers, assignments)
    best = np.argsort(top, axis=1, kind="stable")[:, :keep]
    return node_of[best]
