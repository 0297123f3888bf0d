"""Which sequences run in the next model step, and how many tokens each feeds: plain data and
logic, driven by tests on a simulated clock without a model, HTTP or torch.distributed.

Iteration-level (continuous) batching: the batch is chosen anew before every step, so a new
request joins at the next step and a finished one leaves at once. Per step:
1. Running sequences that decode (one token each) are scheduled first, oldest first, so that a
   long prompt never stalls them.
2. Then running sequences part-way through their prompt take the next chunk of it, within
   what is left of the step's token budget (`max_num_batched_tokens`): chunked prefill.
3. Then waiting requests join, oldest first, while there are fewer than `max_num_seqs`
   running, budget left and blocks for their first chunk; a request's prompt first looks up
   its full blocks in the prefix cache and computes only what it does not find there.
When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed, it goes back to the front of the waiting queue with its
generated tokens kept, and its whole context is recomputed when it runs again (no swapping;
nothing lost or truncated). No waiting request joins in a step that preempted.
With latency targets (`slo`, `slo_policy.py`) the prefill chunk of a step is what its decodes'
TPOT target leaves room for, and a waiting request joins only if the batch with it stays
within that target.

A sequence's `num_computed` counts the tokens whose keys and values are in the cache; the
tokens from there to the end are what it still has to feed. Logits are read (and a token
sampled) only for a chunk that reaches the end of its sequence's tokens.
With speculative decoding (`speculation.py`) a decoding sequence that allows it feeds its last
token and the tokens it guesses next in one chunk; the engine says which of them the model
kept, and the cache holds the keys of those only.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from phalanx.scheduling.block_manager import BlockManager, block_hash
from phalanx.scheduling.request import Request
from phalanx.scheduling.slo_policy import QueueShape
from phalanx.scheduling.speculation import SpeculativeConfig


class QueueFull(Exception):
    """The waiting queue holds `max_waiting` requests already (the API answers 429)."""


@dataclass(eq=False)
class Sequence:
    """The state of serving one request (request.py): its tokens, blocks and times."""
    seq_id: str
    request: Request
    draws: Any = None
    """The state of its sampling (`serve.sampling_params.Draws`: its seeded generator, its place in a
    grammar); the engine starts it at the first draw when the caller did not."""
    payload: Any = None
    """What the server keeps with it (its text so far, where its tokens go)."""
    tokens: list[int] = field(default_factory=list)
    """The prompt, then every generated token."""
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    """Hashes of its full blocks (prefix caching), as far as computed."""
    arrival: float | None = None
    """When it was added (its request's arrival, if the caller set it)."""
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when it first joined."""
    preemptions: int = 0
    may_speculate: bool = False
    """Its steps may guess tokens (speculative decoding): what it asked for can be checked
    token by token (no grammar, no log-probabilities; the caller decides)."""
    drafted: tuple[int, ...] = ()
    """The tokens a draft model proposed after its tokens (speculative decoding by the model's
    multi-token-prediction layer, serve/mtp_draft.py): its next step's guesses."""
    serial: int = field(default_factory=itertools.count().__next__)
    """Unique in this process (the choices of one request share its `seq_id`): what the
    engine's ranks name its block table by (serve/block_tables.py)."""

    def __post_init__(self):
        self.tokens = list(self.request.prompt)

    @classmethod
    def of(cls, seq_id: str, prompt: list[int], max_tokens: int, eos_ids: frozenset[int] = frozenset(), *,
           params=None, prompt_logprobs: int | None = None, **state) -> Sequence:
        """A new sequence of a request made from these fields; `state`: the Sequence's own."""
        return cls(seq_id, Request(tuple(prompt), max_tokens, eos_ids, params, prompt_logprobs), **state)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.request.eos_ids

    @property
    def prompt_logprobs(self) -> int | None:
        return self.request.prompt_logprobs

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int
    """The position of its first token (= num_computed when scheduled)."""
    length: int
    """Tokens fed, the guesses included."""
    guesses: tuple[int, ...] = ()
    """Tokens guessed after the sequence's last (speculative decoding), fed after it."""

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence's tokens: its last logits are read."""
        return self.start + self.length - len(self.guesses) == len(self.seq.tokens)

    @property
    def ids(self) -> list[int]:
        """The token ids it feeds."""
        return self.seq.tokens[self.start:self.start + self.length - len(self.guesses)] + list(self.guesses)


@dataclass
class Step:
    chunks: list[Chunk]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(chunk.length for chunk in self.chunks)


class Scheduler:
    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_waiting: int, prefix_caching: bool = True, clock: Callable[[], float] = time.monotonic,
                 slo=None, speculative: SpeculativeConfig | None = None):
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_num_batched_tokens, self.max_waiting, self.clock = max_num_batched_tokens, max_waiting, clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # by arrival, oldest first
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.preemptions = 0
        self.slo = slo
        """An `slo_policy.SloPolicy`, or None: batches bounded by the flags alone."""
        self.last_step: Step | None = None
        self.speculative = speculative
        self.guessed_tokens = 0
        self.kept_guesses = 0
        """Tokens guessed, and of them kept (the model drew the same), since the start."""

    def queue_shape(self) -> QueueShape:
        """What a request arriving now queues behind (for the SLO policy's admission)."""
        decoding = [s for s in self.running if len(s.tokens) - s.num_computed == 1]
        ahead = [len(s.tokens) - s.num_computed for s in self.running if len(s.tokens) - s.num_computed > 1]
        ahead += [len(s.tokens) for s in self.waiting]
        return QueueShape(len(decoding), sum(len(s.tokens) for s in decoding), tuple(ahead))

    def blocks_needed(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError if a request could never run, even alone: its last token's keys are never
        computed, so it needs blocks for prompt + max_tokens - 1 positions."""
        need = self.blocks_needed(prompt_len + max_tokens - 1)
        if need > self.blocks.num_blocks:
            raise ValueError(f"a prompt of {prompt_len} tokens with max_tokens {max_tokens} needs {need} KV blocks "
                             f"of {self.block_size} positions; the cache has {self.blocks.num_blocks}")

    def add(self, seq: Sequence) -> None:
        self.check_fits(len(seq.prompt), seq.max_tokens)
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting already (the most this server queues)")
        if seq.arrival is None:
            seq.arrival = self.clock()
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence, reason: str = "abort") -> bool:
        """Drop a sequence wherever it is, freeing its blocks; False if it already finished."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return False
        self._free(seq)
        seq.finish_reason, seq.finished_at = reason, self.clock()
        return True

    def schedule(self) -> Step:
        budget = self.max_num_batched_tokens
        chunks: dict[int, Chunk] = {}  # id(seq) -> its chunk, in scheduling order
        preempted: list[Sequence] = []
        for decoding in (True, False):
            if not decoding and self.slo is not None:
                budget = self.slo.prefill_budget(len(chunks), sum(c.start + c.length for c in chunks.values()), budget)
            for seq in list(self.running):
                if seq not in self.running or id(seq) in chunks:
                    continue
                want = len(seq.tokens) - seq.num_computed
                if (want == 1) != decoding or budget == 0:
                    continue
                length = min(want, budget)
                guesses = self._guesses(seq, budget - length) if decoding else ()
                length += len(guesses)
                while self.blocks_needed(seq.num_computed + length) - len(seq.block_table) > self.blocks.num_free:
                    victim = self.running[-1]
                    if id(victim) in chunks:
                        budget += chunks.pop(id(victim)).length
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
                if seq not in self.running:
                    continue
                self._grow(seq, seq.num_computed + length)
                chunks[id(seq)] = Chunk(seq, seq.num_computed, length, guesses)
                budget -= length
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            if self.slo is not None and not self.slo.may_join([len(s.tokens) for s in self.running],
                                                               len(self.waiting[0].tokens)):
                break
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            self._insert_running(chunk.seq)
            chunks[id(chunk.seq)] = chunk
            budget -= chunk.length
        self.last_step = Step(list(chunks.values()), preempted)
        return self.last_step

    def _guesses(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """What a decoding sequence guesses next, within the step's budget and its max_tokens
        (the last token it may have is drawn, never guessed)."""
        if self.speculative is None or not seq.may_speculate:
            return ()
        if (self.speculative.disable_by_batch_size is not None
                and len(self.running) + len(self.waiting) > self.speculative.disable_by_batch_size):
            return ()
        return tuple(self.speculative.propose(seq.tokens, min(room, seq.max_tokens - len(seq.output) - 1), seq.drafted))

    def reserve(self, seq: Sequence, positions: int) -> bool:
        """Blocks for the first `positions` positions of a running sequence now, if free (a
        draft model writes its keys of the positions the next step feeds one step early:
        serve/mtp_draft.py); False when they are not (nothing is preempted for a draft)."""
        if positions > len(seq.prompt) + seq.max_tokens - 1:  # beyond what it may ever hold (check_fits)
            return False
        if self.blocks_needed(positions) - len(seq.block_table) > self.blocks.num_free:
            return False
        self._grow(seq, positions)
        return True

    def _admit(self, seq: Sequence, budget: int) -> Chunk | None:
        """The first chunk of a waiting sequence, after taking its cached prefix, or None when
        the blocks for it are not free."""
        first = seq.num_computed == 0 and seq.preemptions == 0
        # At least the last token is computed, for the logits that pick the next one.
        hashes = self._full_block_hashes(seq.tokens, (len(seq.tokens) - 1) // self.block_size)
        found = self.blocks.find_prefix(hashes) if seq.prompt_logprobs is None else []
        start = len(found) * self.block_size
        length = min(len(seq.tokens) - start, budget)
        need = self.blocks_needed(start + length) - len(found)
        if need > self.blocks.free_after_taking(found):
            return None
        for block in found:
            self.blocks.take(block)
        seq.block_table, seq.hashes, seq.num_computed = list(found), hashes[:len(found)], start
        if first:
            self.prefix_query_tokens += len(seq.tokens)
            self.prefix_hit_tokens += start
            seq.cached_tokens = start
        self._grow(seq, start + length)
        return Chunk(seq, start, length)

    def _full_block_hashes(self, tokens: list[int], count: int) -> list[bytes]:
        hashes: list[bytes] = []
        for index in range(count):
            piece = tokens[index * self.block_size:(index + 1) * self.block_size]
            hashes.append(block_hash(hashes[-1] if hashes else None, piece))
        return hashes

    def _grow(self, seq: Sequence, positions: int) -> None:
        while len(seq.block_table) < self.blocks_needed(positions):
            seq.block_table.append(self.blocks.allocate())

    def _insert_running(self, seq: Sequence) -> None:
        """Keep `running` ordered by arrival: a preempted sequence that returns is old again."""
        index = len(self.running)
        while index > 0 and self.running[index - 1].arrival > seq.arrival:
            index -= 1
        self.running.insert(index, seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed, seq.preemptions = 0, seq.preemptions + 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # the tail is evicted first from the prefix cache
            self.blocks.release(block)
        seq.block_table, seq.hashes = [], []

    def finish_step(self, step: Step, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """After the model ran `step`: its tokens are computed, full blocks enter the prefix
        cache, each sampling chunk's sequence gets its new token (`sampled`: id(seq) -> token
        id; for a chunk with guesses, the list of the guesses kept then the model's next
        token); returns the sequences that finished (their blocks freed)."""
        now, finished = self.clock(), []
        for chunk in step.chunks:
            seq = chunk.seq
            if seq not in self.running:  # aborted while the step ran
                continue
            seq.num_computed = chunk.start + chunk.length - len(chunk.guesses)
            if not chunk.samples:
                self._register_full_blocks(seq)
                continue
            new = sampled[id(seq)]
            new = new if isinstance(new, list) else [new]
            if chunk.guesses:
                self.guessed_tokens += len(chunk.guesses)
                self.kept_guesses += len(new) - 1
            reason = None
            for token in new:
                seq.tokens.append(token)
                if seq.first_token_at is None:
                    seq.first_token_at = now
                reason = "stop" if token in seq.eos_ids else "length" if len(seq.output) >= seq.max_tokens else None
                if reason:
                    break
            seq.num_computed = len(seq.tokens) - 1  # the guesses kept are computed; the last token is not
            self._register_full_blocks(seq)
            if reason:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence (its length, an end-of-text token, or a stop string)."""
        if seq in self.running:
            self.running.remove(seq)
            self._free(seq)
        seq.finish_reason, seq.finished_at = reason, self.clock()

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed // self.block_size
        while len(seq.hashes) < full:
            index = len(seq.hashes)
            piece = seq.tokens[index * self.block_size:(index + 1) * self.block_size]
            seq.hashes.append(block_hash(seq.hashes[-1] if seq.hashes else None, piece))
            self.blocks.register(seq.block_table[index], seq.hashes[-1])
