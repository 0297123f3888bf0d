"""The block tables every rank keeps (serve/block_tables.py): the changes rank 0 sends bring a
rank's copy to exactly the scheduler's tables through growth, a shrink (a rejected guess's
block freed), a preemption's fresh blocks and finished sequences; and a decode step of a long
sequence sends a few numbers, not its table."""

import pickle
import random

from phalanx.scheduling.scheduler import Chunk, Scheduler, Sequence, Step
from phalanx.serve.block_tables import BlockTables
from phalanx.serve.input_batch import step_message


def _check(rank: BlockTables, sent: BlockTables, tables: dict[int, list[int]], live: set[int]) -> None:
    rank.apply(sent.changes(list(tables.items()), live))
    for serial, table in tables.items():
        assert rank[serial] == table
    assert set(rank.tables) <= live | set(tables)
    assert rank.tables == sent.tables


def test_every_kind_of_change_reaches_the_ranks_copy():
    sent, rank = BlockTables(), BlockTables()
    _check(rank, sent, {1: [4, 5], 2: [7]}, {1, 2})
    _check(rank, sent, {1: [4, 5, 9]}, {1, 2})  # grown by a block; 2 skipped this step, kept
    assert rank[2] == [7]
    _check(rank, sent, {1: [4, 5]}, {1, 2})  # shrunk: a rejected guess's block freed
    _check(rank, sent, {2: [3, 8]}, {2})  # 1 finished (dropped), 2 preempted and back on new blocks
    assert 1 not in rank.tables
    _check(rank, sent, {}, set())
    assert rank.tables == {}


def test_random_histories_keep_the_copies_equal():
    """A thousand random steps of growing, shrinking, replaced and finished tables."""
    rng = random.Random(0)
    sent, rank, truth = BlockTables(), BlockTables(), {}
    for _ in range(1000):
        for serial in list(truth):
            roll = rng.random()
            if roll < 0.05:
                del truth[serial]
            elif roll < 0.1:
                truth[serial] = [rng.randrange(100) for _ in range(rng.randrange(1, 6))]
            elif roll < 0.4:
                truth[serial] = truth[serial] + [rng.randrange(100)]
            elif roll < 0.5 and len(truth[serial]) > 1:
                truth[serial] = truth[serial][:-1]
        if rng.random() < 0.3:
            truth[rng.randrange(10**6)] = [rng.randrange(100)]
        stepped = {serial: table for serial, table in truth.items() if rng.random() < 0.7}
        _check(rank, sent, {s: list(t) for s, t in stepped.items()}, set(truth))
        for serial in stepped:
            assert rank[serial] == truth[serial]


def test_a_long_sequences_decode_sends_no_table():
    """After its prompt, a decode step of a sequence 4096 positions long sends nothing of its
    table until a block fills; the message stays the same size however long the sequence."""
    scheduler = Scheduler(num_blocks=300, block_size=16, max_num_seqs=4, max_num_batched_tokens=8192,
                          max_waiting=4)
    seq = Sequence.of("long", list(range(4096)), 100)
    scheduler.add(seq)
    sent = BlockTables()
    message, _ = step_message(scheduler.schedule(), scheduler.running, sent)
    assert message.tables.grown[seq.serial] == (0, seq.block_table)  # the whole table, once
    scheduler.finish_step(scheduler.last_step, {id(seq): 1})
    sizes = []
    for token in range(2, 6):
        message, _ = step_message(scheduler.schedule(), scheduler.running, sent)
        sizes.append(len(pickle.dumps(message)))
        if len(seq.tokens) % 16 != 1:  # no new block this step
            assert message.tables.grown == {}
        scheduler.finish_step(scheduler.last_step, {id(seq): token})
    assert max(sizes) < 400, sizes


def test_choices_of_one_request_keep_their_own_tables():
    """The n choices of a request share its id; their tables must not."""
    a, b = Sequence.of("cmpl-1", [1, 2, 3], 4), Sequence.of("cmpl-1", [1, 2, 3], 4)
    a.block_table, b.block_table = [0], [1]
    sent = BlockTables()
    message, _ = step_message(Step([Chunk(a, 0, 3), Chunk(b, 0, 3)], []), [a, b], sent)
    assert a.serial != b.serial
    assert message.tables.grown == {a.serial: (0, [0]), b.serial: (0, [1])}
