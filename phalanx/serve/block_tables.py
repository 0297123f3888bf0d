"""The block tables every rank keeps from step to step (vLLM's persistent batch): a step's
message carries only what changed, not every running sequence's whole table.

A sequence's block table (`scheduling/block_manager.py`) grows by one block every
`block_size` tokens and otherwise stays as it is; sent whole with every forward, a decode of a
sequence at 8k positions in 16-position blocks would carry 512 block ids each step to say
"one more token". So rank 0 keeps a copy of what it last sent for each running sequence
(`BlockTables.changes`), and the message says, per sequence whose table changed, how many of
its blocks the ranks keep and the blocks after them (the common prefix covers growth,
a rejected guess's freed block and a preempted sequence's new blocks alike), and which
sequences are gone. Every rank applies the same changes (`apply`) to its own copy, rank 0's
model runner included, so one code path serves one process and many.

Sequences are named by their `serial` (unique in the process), not their request's id: the
choices of one request share that.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TableChanges:
    """What changed since the last step, as plain data (it rides in the step's message)."""
    grown: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    """serial -> (blocks kept of its previous table, the blocks after them)."""
    dropped: tuple[int, ...] = ()
    """Serials no longer running (finished, aborted or preempted): their tables are forgotten."""


class BlockTables:
    def __init__(self):
        self.tables: dict[int, list[int]] = {}

    def __getitem__(self, serial: int) -> list[int]:
        return self.tables[serial]

    def changes(self, tables: list[tuple[int, list[int]]], live: set[int]) -> TableChanges:
        """Rank 0: the changes that bring every rank from the tables last sent to `tables`
        ((serial, block table) of the step's sequences), forgetting those not in `live` (the
        running sequences' serials); applied here too, so that the next call diffs against them."""
        grown = {}
        for serial, table in tables:
            old = self.tables.get(serial)
            if old == table:
                continue
            kept = _common_prefix(old, table) if old else 0
            grown[serial] = (kept, table[kept:])
        changes = TableChanges(grown, tuple(serial for serial in self.tables if serial not in live and serial not in grown))
        self.apply(changes)
        return changes

    def apply(self, changes: TableChanges) -> None:
        """Every rank: its copy of the tables brought up to date."""
        for serial in changes.dropped:
            self.tables.pop(serial, None)
        for serial, (kept, new) in changes.grown.items():
            self.tables[serial] = self.tables.get(serial, [])[:kept] + new


def _common_prefix(old: list[int], new: list[int]) -> int:
    """How many leading blocks two tables share."""
    for index, (a, b) in enumerate(zip(old, new)):
        if a != b:
            return index
    return min(len(old), len(new))
