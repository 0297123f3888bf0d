"""A mixed cluster: groups of machines of different kinds (2 x dgx-h100 nodes and 4 x dgx-a100
nodes, say), each group homogeneous, and the network between the groups. `phalanx plan` and
`phalanx simulate` read it from a cluster file with a `groups` list (docs/planner.md, Mixed
clusters); `mixed_search.py` plans over it (`mixed_dp.py`, `mixed_pipeline.py`).

    name = "h100+a100"
    between_bw_gbs = 12.5        # per device, between groups (optional)
    between_latency_us = 10      # optional
    [[groups]]
    preset = "dgx-h100"          # a preset or a homogeneous cluster file
    nodes = 2
    [[groups]]
    preset = "dgx-a100"
    nodes = 4

Devices are numbered group by group in the file's order (the first group's nodes hold ranks
0 ..): the order the plan's shares and pipeline stages are given in.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import UserError
from phalanx.planner.hardware import PRESETS, Cluster, cluster_from_name

TOP_KEYS = ("name", "groups", "between_bw_gbs", "between_latency_us")
GROUP_KEYS = ("preset", "nodes", "name")


@dataclass(frozen=True)
class Group:
    """`nodes` machines of one kind."""
    name: str
    cluster: Cluster
    nodes: int

    @property
    def devices(self) -> int:
        return self.nodes * self.cluster.devices_per_node


@dataclass(frozen=True)
class MixedCluster:
    name: str
    groups: tuple[Group, ...]
    between_bw_gbs: float
    """Bandwidth per device (GB/s per direction) of the links between two groups: what a
    collective or a pipeline send that crosses groups runs at (default: the slowest group's
    own `inter_bw_gbs`, its NICs)."""
    between_latency_us: float
    """Per-step latency between groups (default: the slowest group's `inter_latency_us`)."""

    @property
    def devices(self) -> int:
        return sum(g.devices for g in self.groups)

    def describe(self) -> str:
        return " + ".join(f"{g.nodes} x {g.cluster.name} ({g.devices} devices)" for g in self.groups)


def is_mixed_cluster_file(name: str) -> bool:
    """Whether `--cluster NAME` is a file with a `groups` list (read, not guessed by name)."""
    if name in PRESETS or not name.endswith((".toml", ".json")):
        return False
    try:
        return "groups" in _read(Path(name))
    except UserError:
        return False  # the homogeneous reader says what is wrong with it


def _read(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read cluster file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"cluster file {str(path)!r} is not text; expected TOML or JSON") from None
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cluster file {str(path)!r} is not valid {path.suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"cluster file {str(path)!r}: expected a table, got {type(data).__name__}")
    return data


def _positive(source: str, key: str, raw, *, zero_ok: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) \
            or raw < 0 or (raw == 0 and not zero_ok):
        bound = "at least 0" if zero_ok else "above 0"
        raise UserError(f"{source}: {key} must be a finite number {bound}, got {raw!r}")
    return float(raw)


def mixed_cluster_from_dict(data: dict, *, source: str) -> MixedCluster:
    """Build a MixedCluster from parsed file contents; one-line errors name the bad part."""
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise UserError(f"{source}: unknown mixed-cluster key {unknown[0]!r}; valid keys: {', '.join(TOP_KEYS)} "
                        "(each group's hardware comes from its preset or file)")
    raw_groups = data.get("groups")
    if not isinstance(raw_groups, list) or not raw_groups:
        raise UserError(f"{source}: groups must be a non-empty list of {{preset, nodes}} tables")
    groups = []
    for i, raw in enumerate(raw_groups):
        where = f"{source}: groups[{i}]"
        if not isinstance(raw, dict):
            raise UserError(f"{where} must be a table with preset and nodes, got {raw!r}")
        bad = sorted(set(raw) - set(GROUP_KEYS))
        if bad:
            raise UserError(f"{where}: unknown key {bad[0]!r}; valid keys: {', '.join(GROUP_KEYS)}")
        if "preset" not in raw or "nodes" not in raw:
            raise UserError(f"{where} needs both preset (a preset or cluster file) and nodes")
        nodes = raw["nodes"]
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise UserError(f"{where}: nodes must be a whole number of at least 1, got {nodes!r}")
        preset = str(raw["preset"])
        if preset == "local":
            raise UserError(f"{where}: preset 'local' (this machine's CPUs) cannot be a group of a mixed cluster")
        cluster = cluster_from_name(preset)  # an unknown preset: its one-line error, listing the presets
        if cluster.shared_compute:
            raise UserError(f"{where}: {cluster.name!r} is a CPU cluster (shared_compute); mixed clusters plan GPU groups")
        groups.append(Group(name=str(raw.get("name", cluster.name)), cluster=cluster, nodes=nodes))
    slowest_bw = min(g.cluster.inter_bw_gbs for g in groups)
    slowest_latency = max(g.cluster.inter_latency_us for g in groups)
    bw = _positive(source, "between_bw_gbs", data.get("between_bw_gbs", slowest_bw))
    latency = _positive(source, "between_latency_us", data.get("between_latency_us", slowest_latency), zero_ok=True)
    return MixedCluster(name=str(data.get("name", Path(source).stem)), groups=tuple(groups),
                        between_bw_gbs=bw, between_latency_us=latency)


def load_mixed_cluster(path: str | Path) -> MixedCluster:
    return mixed_cluster_from_dict(_read(Path(path)), source=str(path))
