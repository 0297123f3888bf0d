"""What a scheduled step feeds the model, as plain data: at most two forwards (decodes, one
sequence per batch row, and prompt chunks packed into one row: `paged_cache.py`), which of
their positions' logits are read, and what each read row is for.

A `Forward` names each chunk's sequence by its serial; its block table travels separately, as
changes to the tables every rank keeps (`block_tables.py`). Rank 0 sends a step as a
`StepMessage`; every rank, rank 0 included, runs it through its `model_runner.ModelRunner`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.scheduling.scheduler import Chunk, Sequence, Step
from phalanx.serve.block_tables import BlockTables, TableChanges


@dataclass(frozen=True)
class Forward:
    """One forward of a step: the token ids, each chunk as (sequence serial, first position,
    tokens), and which tokens' logits are read (the last of each sampling chunk, and the
    positions after its guesses), by index into `ids`."""
    ids: list[int]
    chunks: list[tuple[int, int, int]]
    read_at: list[int]


@dataclass(frozen=True)
class StepMessage:
    """What rank 0 sends every rank for one step (one scheduler's): the block tables' changes,
    then the forwards."""
    tables: TableChanges
    forwards: list[Forward]


@dataclass
class Reads:
    """Which rows of a step's logits (its forwards' read rows, concatenated) are read for what:
    `chunks`' tokens are drawn from rows `sample_rows`, and rows `prompt_rows` score the prompt
    token after position `prompt[i][1]` of sequence `prompt[i][0]` (prompt_logprobs.py)."""
    chunks: list[Chunk] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt: list[tuple[Sequence, int]] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    guess_rows: list[list[int]] = field(default_factory=list)
    """Per chunk of `chunks`, the rows after each of its guesses (speculative decoding), by
    index into the step's logits rows (as `sample_rows`)."""


def step_forwards(step: Step) -> tuple[list[Forward], Reads]:
    """The step as at most two forwards, decodes (one sequence per row) and prompt chunks
    (packed, paged_cache.py), and which logits rows they read: the last position of each
    sampling chunk, and every prompt position of a sequence whose prompt is scored."""
    groups = [[c for c in step.chunks if c.length == 1], [c for c in step.chunks if c.length > 1]]
    forwards, reads, rows = [], Reads(), 0
    for chunks in groups:
        if not chunks:
            continue
        ids, refs, read_at = [], [], []
        for chunk in chunks:
            first = len(ids)
            ids += chunk.ids
            refs.append((chunk.seq.serial, chunk.start, chunk.length))
            if chunk.seq.prompt_logprobs is not None and not chunk.seq.output:  # (not again after a preemption)
                # Position p scores prompt token p + 1; the prompt's last position draws the first token.
                for position in range(chunk.start, min(chunk.start + chunk.length, len(chunk.seq.prompt) - 1)):
                    read_at.append(first + position - chunk.start)
                    reads.prompt.append((chunk.seq, position))
                    reads.prompt_rows.append(rows + len(read_at) - 1)
            if chunk.samples:
                guessed = len(chunk.guesses)
                read_at.append(len(ids) - 1 - guessed)
                reads.chunks.append(chunk)
                reads.sample_rows.append(rows + len(read_at) - 1)
                reads.guess_rows.append([rows + len(read_at) + i for i in range(guessed)])
                read_at += range(len(ids) - guessed, len(ids))
        forwards.append(Forward(ids, refs, read_at))
        rows += len(read_at)
    return forwards, reads


def step_message(step: Step, running: list[Sequence], sent: BlockTables) -> tuple[StepMessage, Reads]:
    """The step as rank 0 sends it: the forwards, and the changes to the block tables of
    `sent` (what the ranks hold since the last message) that they need; `running`: the
    scheduler's running sequences (the others' tables are dropped)."""
    forwards, reads = step_forwards(step)
    tables = [(chunk.seq.serial, chunk.seq.block_table) for chunk in step.chunks]
    return StepMessage(sent.changes(tables, {seq.serial for seq in running}), forwards), reads
