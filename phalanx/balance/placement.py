"""Where each expert's replicas go: the problem's rules, and the greedy construction.

Hierarchical policy (the reference's, DeepSeek EPLB): pack expert groups onto nodes (equal
numbers of groups per node, heaviest group first into the lightest node), so a token's experts
sit on one node; replicate within each node; pack each node's replicas onto its GPUs. Global
policy: one node holding every group, all GPUs its own. `auto` takes hierarchical when the groups
split evenly over the nodes, as the reference does.

phalanx adds one rule: no GPU holds two replicas of one expert (a second copy on the same GPU
serves no token the first could not, and takes a slot another expert could use). So an expert
gets at most as many replicas as there are GPUs it may use: the GPUs of its node. Where that
rule does not bite, `greedy` is the reference's algorithm exactly (`distinct=False` is the
reference itself, for comparison).

All of it runs in the node frame: one row per (layer, node), holding that node's experts under
node-local ids 0..m-1 (`local2log` names them), its GPUs and their slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phalanx.balance.packing import pack, pack_replicas, replicate, spread
from phalanx.errors import UserError

POLICIES = ("auto", "hierarchical", "global")


@dataclass(frozen=True)
class Problem:
    """The flags of a placement, checked once; every message shows the numbers involved."""

    layers: int
    experts: int
    replicas: int  # physical slots per layer
    groups: int
    nodes: int
    gpus: int
    policy: str  # "hierarchical" or "global" (auto resolved)

    @property
    def frame_nodes(self) -> int:
        """Nodes the construction sees: the real ones, or one under the global policy."""
        return self.nodes if self.policy == "hierarchical" else 1

    @property
    def slots_per_gpu(self) -> int:
        return self.replicas // self.gpus


def check_problem(layers: int, experts: int, replicas: int, groups: int, nodes: int, gpus: int, policy: str = "auto") -> Problem:
    """Validate the flags against the load's shape (layers x experts); resolve `auto`."""
    shape = f"the load has {layers} layers x {experts} experts"
    for name, value in (("--replicas", replicas), ("--groups", groups), ("--nodes", nodes), ("--gpus", gpus)):
        if value < 1:
            raise UserError(f"{name}={value} must be at least 1")
    if policy not in POLICIES:
        raise UserError(f"--policy={policy!r} is not one of {', '.join(POLICIES)}")
    if layers < 1 or experts < 1:
        raise UserError(f"{shape}; it needs at least one of each")
    if experts % groups:
        raise UserError(f"--groups={groups} does not divide the {experts} experts ({shape})")
    if gpus % nodes:
        raise UserError(f"--gpus={gpus} is not divisible by --nodes={nodes}")
    if replicas % gpus:
        raise UserError(f"--replicas={replicas} slots do not split evenly over --gpus={gpus}")
    if replicas < experts:
        raise UserError(f"--replicas={replicas} is fewer slots than the {experts} experts ({shape})")
    if policy == "auto":
        policy = "hierarchical" if groups % nodes == 0 else "global"
    if policy == "hierarchical" and groups % nodes:
        raise UserError(f"the hierarchical policy needs --groups={groups} divisible by --nodes={nodes}")
    problem = Problem(layers, experts, replicas, groups, nodes, gpus, policy)
    n = problem.frame_nodes
    node_slots, node_experts, node_gpus = replicas // n, experts // n, gpus // n
    if node_slots > node_experts * node_gpus:
        where = f"{n} nodes" if n > 1 else "1 node (global policy)"
        raise UserError(
            f"{node_slots} slots per node is more than its {node_experts} experts x {node_gpus} GPUs = "
            f"{node_experts * node_gpus} ({replicas} slots, {experts} experts, {gpus} GPUs over {where}): "
            "the rest could only be filled with two replicas of one expert on one GPU"
        )
    return problem


@dataclass
class NodeFrame:
    """A placement in the node frame (rows = layers x frame nodes, layer-major)."""

    local2log: np.ndarray  # (layers, nodes, width): the expert behind each node-local id, -1 for none
    slots: np.ndarray  # (rows, gpus per node, slots per GPU): node-local id in each slot
    count: np.ndarray  # (rows, width): replicas of each node-local id (0 where it names no expert)

    def phy2log(self) -> np.ndarray:
        """(layers, replicas): the expert each slot holds; node k's slots follow node k-1's."""
        layers, nodes, width = self.local2log.shape
        local = self.slots.reshape(layers * nodes, -1)
        return np.take_along_axis(self.local2log.reshape(layers * nodes, width), local, axis=1).reshape(layers, -1)

    def node_load(self, load: np.ndarray) -> np.ndarray:
        """(rows, width): the load of the expert behind each node-local id (0 where none)."""
        layers, nodes, width = self.local2log.shape
        ids = self.local2log.reshape(layers, -1)
        return np.where(ids >= 0, np.take_along_axis(load, np.maximum(ids, 0), axis=1), 0.0).reshape(layers * nodes, width)

    def unit(self, load: np.ndarray) -> np.ndarray:
        """(rows, width): the load one replica of each node-local id carries (0 where none)."""
        return self.node_load(load) / np.maximum(self.count, 1)


def group_bounds(problem: Problem) -> tuple[int, int]:
    """The fewest and most groups a node may hold (hierarchical policy), given the two rules.

    Every expert needs a slot on its node (at most node slots / group size groups), and no GPU
    holds an expert twice (at least node slots / (group size x GPUs per node) groups). Equal
    numbers per node, the reference's choice, lie within these bounds (check_problem).
    """
    n, groups = problem.nodes, problem.groups
    group_size, node_gpus, node_slots = problem.experts // groups, problem.gpus // n, problem.replicas // n
    low, high = -(-node_slots // (group_size * node_gpus)), node_slots // group_size
    high = min(high, groups - (n - 1) * low)
    return max(low, groups - (n - 1) * high), high


def greedy(load: np.ndarray, problem: Problem, *, distinct: bool = True, even_groups: bool = True,
           node_of_group: np.ndarray | None = None) -> NodeFrame:
    """The construction: groups onto nodes, replicas within nodes, replicas onto GPUs.

    `distinct=True` caps each expert's replicas at its node's GPUs and never packs two on one
    GPU; `distinct=False` is the reference, which does neither. `even_groups=False` (with the
    hierarchical policy) lets nodes hold different numbers of groups, within `group_bounds`:
    where one group is hot, its node can then hold fewer others (the node's slots stay the same).
    `node_of_group` (layers, groups), within those bounds, sets the nodes instead of step 1.
    """
    layers, experts = load.shape
    n = problem.frame_nodes
    groups = problem.groups if n > 1 else 1
    group_size, node_gpus = experts // groups, problem.gpus // n

    # 1. groups onto nodes: node-local id = position of the group on its node * group_size + k
    group_load = load.reshape(layers, groups, group_size).sum(axis=2)  # (layers, groups)
    if node_of_group is not None:
        node = node_of_group
        on_node = node[:, :, None] == np.arange(n)  # (layers, groups, nodes)
        position = (np.cumsum(on_node, axis=1) - 1)[on_node].reshape(layers, groups)  # earlier groups on its node
        width = group_bounds(problem)[1] * group_size
    elif even_groups or n == 1:
        node, position = pack(group_load, n)
        width = experts // n  # ids per node
    else:
        low, high = group_bounds(problem)
        node, position = spread(group_load, n, low, high)
        width = high * group_size
    log2local = (node * width + position * group_size)[:, :, None] + np.arange(group_size)  # (layers, groups, group_size)
    local2log = np.full((layers, n * width), -1, dtype=np.int64)
    np.put_along_axis(local2log, log2local.reshape(layers, experts), np.arange(experts)[None, :], axis=1)
    local2log = local2log.reshape(layers, n, width)
    present = (local2log >= 0).reshape(layers * n, width)

    # 2. replicas within each node, (rows, width) with rows = layers * n
    frame = NodeFrame(local2log, np.empty(0, dtype=np.int64), np.ones((layers * n, width), dtype=np.int64))
    node_load = frame.unit(load)  # one replica each: the experts' loads
    replica_expert, frame.count = replicate(node_load, problem.replicas // n, node_gpus if distinct else None,
                                            None if present.all() else present)

    # 3. replicas onto the node's GPUs
    frame.slots = pack_replicas(frame.unit(load), replica_expert, node_gpus, distinct)
    return frame
