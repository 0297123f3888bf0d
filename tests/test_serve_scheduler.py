"""The serving scheduler's rules on scripted arrivals, on a simulated clock (one tick per step),
without a model: every sampled token is 1 unless a script says otherwise."""

from __future__ import annotations

import pytest

from phalanx.scheduling.block_manager import BlockManager
from phalanx.scheduling.scheduler import QueueFull, Scheduler, Sequence


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(clock: Clock, **limits) -> Scheduler:
    settings = dict(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_waiting=8) | limits
    return Scheduler(**settings, clock=clock)


def _drive(scheduler: Scheduler, clock: Clock, arrivals: dict[int, list[Sequence]], max_steps: int = 200):
    """Run steps, adding each tick's arrivals first; returns every step's {seq_id: tokens fed}."""
    steps = []
    for tick in range(max_steps):
        clock.now = float(tick)
        for seq in arrivals.get(tick, []):
            scheduler.add(seq)
        if not scheduler.has_work() and tick > max(arrivals, default=0):
            break
        step = scheduler.schedule()
        assert step.num_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        steps.append({chunk.seq.seq_id: chunk.length for chunk in step.chunks})
        scheduler.finish_step(step, {id(chunk.seq): 1 for chunk in step.chunks if chunk.samples})
    return steps


def _seq(name: str, prompt_len: int, max_tokens: int, first: int = 0) -> Sequence:
    return Sequence.of(name, list(range(first, first + prompt_len)), max_tokens)


def test_decodes_first_and_a_long_prompt_in_chunks():
    """"a" decodes when "b"'s 40-token prompt arrives; under a 16-token budget "a" still feeds
    its one token every step while "b" takes the other 15 in chunks, and "b" gets its first
    token once its prompt is through (3 steps: 15 + 15 + 10)."""
    clock = Clock()
    scheduler = _scheduler(clock)
    a, b = _seq("a", 4, 10), _seq("b", 40, 3, first=50)
    steps = _drive(scheduler, clock, {0: [a], 2: [b]})
    assert steps[0] == {"a": 4}
    assert steps[2] == {"a": 1, "b": 15} and steps[3] == {"a": 1, "b": 15} and steps[4] == {"a": 1, "b": 10}
    assert steps[5] == {"a": 1, "b": 1}
    assert b.first_token_at == 4.0 and a.first_token_at == 0.0
    assert len(a.output) == 10 and len(b.output) == 3
    assert a.finish_reason == b.finish_reason == "length"


def test_joins_next_step_and_leaves_at_once():
    """Continuous batching: a request arriving at tick 3 is in tick 3's step; one that finishes
    is gone from the next step and its blocks are free."""
    clock = Clock()
    scheduler = _scheduler(clock)
    a, b = _seq("a", 3, 2), _seq("b", 3, 6)
    steps = _drive(scheduler, clock, {0: [a], 3: [b]})
    assert "b" in steps[3] and "a" not in steps[2]  # a: prefill + 1 decode, done at tick 1
    assert scheduler.blocks.num_used == 0 and not scheduler.has_work()


def test_max_num_seqs_and_waiting_queue():
    clock = Clock()
    scheduler = _scheduler(clock, max_num_seqs=2, max_waiting=2)
    seqs = [_seq(str(i), 3, 4) for i in range(4)]
    for seq in seqs[:2]:
        scheduler.add(seq)
    step = scheduler.schedule()
    assert [c.seq.seq_id for c in step.chunks] == ["0", "1"]
    scheduler.add(seqs[2])
    scheduler.add(seqs[3])
    with pytest.raises(QueueFull):
        scheduler.add(_seq("late", 3, 4))
    scheduler.finish_step(step, {id(c.seq): 1 for c in step.chunks})
    assert [c.seq.seq_id for c in scheduler.schedule().chunks] == ["0", "1"]  # 2 and 3 wait for a seat


def test_request_larger_than_the_cache_is_refused():
    scheduler = _scheduler(Clock(), num_blocks=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        scheduler.add(_seq("big", 12, 6))  # 12 + 6 - 1 = 17 positions: 5 blocks of 4
    scheduler.add(_seq("fits", 12, 5))  # 16 positions: 4 blocks


def test_preemption_frees_requeues_and_recomputes():
    """6 blocks of 4 for three sequences of 8 + 8 tokens (4 blocks each at the end): the newest
    running one is preempted when blocks run out, goes to the front of the queue with its
    tokens, and is recomputed later; every sequence ends with all 8 tokens, nothing lost.
    Without prefix caching, which would hand the victim back its own freed blocks."""
    clock = Clock()
    scheduler = _scheduler(clock, num_blocks=6, max_num_batched_tokens=32, prefix_caching=False)
    seqs = [_seq(name, 8, 8, first=10 * i) for i, name in enumerate("abc")]
    steps = _drive(scheduler, clock, {0: seqs})
    assert scheduler.preemptions > 0
    assert all(len(seq.output) == 8 and seq.finish_reason == "length" for seq in seqs)
    assert all(seq.tokens[:8] == list(range(10 * i, 10 * i + 8)) for i, seq in enumerate(seqs))
    preempted = [seq for seq in seqs if seq.preemptions]
    assert "a" not in {seq.seq_id for seq in preempted}, "the oldest is never the victim while others run"
    # The step after a preemption recomputes the victim's prompt and its generated tokens at once.
    victim = preempted[0]
    assert any(step.get(victim.seq_id, 0) > 8 for step in steps)
    assert scheduler.blocks.num_used == 0


def test_prefix_blocks_are_shared_and_counted():
    """"b" arrives after "a" computed its prompt: their common 9-token prefix holds 2 full
    blocks of 4, which "b" shares (reference count 2) and does not compute."""
    clock = Clock()
    scheduler = _scheduler(clock)
    shared = list(range(9))
    a = Sequence.of("a", shared + [40, 41], 6)
    b = Sequence.of("b", shared + [50], 6)
    steps = _drive(scheduler, clock, {0: [a], 2: [b]})
    assert steps[2]["b"] == 10 - 8
    assert b.cached_tokens == 8 and a.cached_tokens == 0
    assert scheduler.prefix_hit_tokens == 8 and scheduler.prefix_query_tokens == 11 + 10
    assert not scheduler.has_work()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    """The same 8-token prompt twice (exactly 2 blocks): the second finds both blocks but must
    compute at least its last token for the logits, so it takes only the first block."""
    clock = Clock()
    scheduler = _scheduler(clock)
    a, b = _seq("a", 8, 2), _seq("b", 8, 2)
    steps = _drive(scheduler, clock, {0: [a], 3: [b]})
    assert b.cached_tokens == 4 and steps[3]["b"] == 4


def test_freed_prefix_blocks_stay_findable_until_evicted():
    manager = BlockManager(num_blocks=2, block_size=4)
    block = manager.allocate()
    manager.register(block, b"prefix")
    manager.release(block)
    assert manager.num_free == 2 and manager.find_prefix([b"prefix"]) == [block]
    other = manager.allocate()  # the fresh block goes first
    assert other != block and manager.find_prefix([b"prefix"]) == [block]
    evicting = manager.allocate()  # none fresh: the cached one is evicted and forgotten
    assert evicting == block and manager.find_prefix([b"prefix"]) == []


def test_abort_frees_blocks():
    clock = Clock()
    scheduler = _scheduler(clock)
    a = _seq("a", 10, 20)
    scheduler.add(a)
    step = scheduler.schedule()
    scheduler.finish_step(step, {id(a): 1})
    assert scheduler.blocks.num_used == 3
    assert scheduler.abort(a) and scheduler.blocks.num_used == 0 and not scheduler.has_work()
    assert not scheduler.abort(a)
