"""Alpha-beta times of collectives, given where a group's ranks sit on the two link levels.

Rank order is phalanx's (docs/layout.md): tp innermost, then dp (ep carved from consecutive
dp ranks), then pp outermost. A group of `size` ranks whose consecutive members are `stride`
ranks apart therefore has `per_domain` members inside each fast (NVLink) domain.

Bandwidth of a group that spans domains: each domain's `per_domain` members each drive their
own NIC, and hierarchical/multi-ring algorithms reach about `per_domain * inter_bw` of bus
bandwidth, never more than the fast link itself. That is why DGX A100 clusters report about
8 x 24 = 190 GB/s of all-reduce bus bandwidth across nodes, and why a dp group of one GPU per
node gets only its own NIC's 47 GB/s.
"""

from __future__ import annotations

import math

from phalanx.planner.hardware import Cluster


def per_domain(cluster: Cluster, *, size: int, stride: int) -> int:
    """How many members of a strided group share one fast domain."""
    if stride >= cluster.fast_domain:
        return 1
    return max(1, min(size, cluster.fast_domain // stride))


def _bus_bw(cluster: Cluster, size: int, local: int) -> float:
    """Achieved bus bandwidth in bytes/s of a group with `local` members per fast domain."""
    intra = cluster.intra_link(local)[1]
    if size <= local:
        return intra * 1e9
    return min(intra, local * cluster.inter_bw_gbs) * 1e9


def _latency(cluster: Cluster, size: int, local: int, steps_per_level: float) -> float:
    """Alpha term of an all-reduce: ring steps inside a domain, tree depth (log2) across
    domains (NCCL's Tree algorithm, which it uses for all-reduce at scale)."""
    alpha = steps_per_level * (local - 1) * cluster.intra_link(local)[0]
    if size > local:
        alpha += steps_per_level * math.ceil(math.log2(size / local)) * cluster.inter_latency_us
    return alpha * 1e-6


def _ring_latency(cluster: Cluster, size: int, local: int) -> float:
    """Alpha term of a ring reduce-scatter or all-gather: size - 1 hops, one per step.

    NCCL runs these two only as rings (Jeaugey, "PAT: a new algorithm for all-gather and
    reduce-scatter operations at scale", 2025: the ring's linear latency is what PAT, for one
    GPU per node, addresses), so latency grows with the group, not its logarithm. Of the
    hops, one per domain boundary crossed (size/local - 1) runs at the inter-domain latency,
    the rest inside a domain.
    """
    domains = max(1, size // local)
    hops_across = domains - 1
    hops_inside = size - 1 - hops_across
    return (hops_inside * cluster.intra_link(local)[0] + hops_across * cluster.inter_latency_us) * 1e-6


def all_reduce(cluster: Cluster, nbytes: float, *, size: int, stride: int) -> float:
    """Seconds to all-reduce `nbytes` per rank: 2(n-1)/n S / busbw + latency."""
    if size <= 1:
        return 0.0
    local = per_domain(cluster, size=size, stride=stride)
    return 2 * (size - 1) / size * nbytes / _bus_bw(cluster, size, local) + _latency(cluster, size, local, 2)


def reduce_scatter(cluster: Cluster, nbytes: float, *, size: int, stride: int) -> float:
    """Seconds to reduce-scatter (or all-gather) `nbytes` of full buffer: (n-1)/n S / busbw."""
    if size <= 1:
        return 0.0
    local = per_domain(cluster, size=size, stride=stride)
    return (size - 1) / size * nbytes / _bus_bw(cluster, size, local) + _ring_latency(cluster, size, local)


all_gather = reduce_scatter


def all_to_all(cluster: Cluster, nbytes: float, *, size: int, stride: int) -> float:
    """Seconds for an all-to-all where each rank sends `nbytes` in total (1/n to each peer).

    The share going to peers in other domains, (n - local)/n, leaves through the rank's own
    NIC; the rest stays on the fast link. The two proceed at once, so the slower one counts.
    """
    if size <= 1:
        return 0.0
    local = per_domain(cluster, size=size, stride=stride)
    inside = (local - 1) / size * nbytes / (cluster.intra_link(local)[1] * 1e9)
    outside = (size - local) / size * nbytes / (cluster.inter_bw_gbs * 1e9)
    return max(inside, outside) + _latency(cluster, size, local, 1)


def send(cluster: Cluster, nbytes: float, *, same_domain: bool) -> float:
    """Seconds for one point-to-point send (pipeline stage boundary)."""
    if same_domain:
        latency, bw = cluster.intra_link(2)
        return nbytes / (bw * 1e9) + latency * 1e-6
    return nbytes / (cluster.inter_bw_gbs * 1e9) + cluster.inter_latency_us * 1e-6
