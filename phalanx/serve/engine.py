"""One engine step: the scheduler's batch through the model, then a token for each sequence
whose chunk reached its end.

The step's chunks are packed into one batch row (1, tokens) (`paged_cache.py`); the model is
the training code's own `Transformer`, in whatever layout it was loaded (under tensor
parallelism its vocabulary-sharded logits are gathered with `full_tensor()`), and only the
last position of each sampling chunk is projected onto the vocabulary. Sampling is the batch
sampler `phalanx generate` also uses (`inference/sampling.py`: penalties, bias, top-k/top-p/min-p
on the step's logits at once), with one seeded generator per request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from phalanx.cpu_ops import decode_kernel as cpu_decode_kernel
from phalanx.inference.grammar import Matcher
from phalanx.inference.sampling import Row, Sampling, sample, token_logprobs
from phalanx.scheduling.scheduler import Chunk, Scheduler, Sequence, Step
from phalanx.serve.expert_loads import ExpertLoads
from phalanx.serve.paged_cache import ChunkLayout, PagedKVCache
from phalanx.serve.prompt_logprobs import PromptScore, PromptScores
from phalanx.serve.speculative import kept_and_next


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are picked, as it asked (a Request's `params`; vLLM's
    SamplingParams): `sampling` is `phalanx generate`'s, its seed included."""
    sampling: Sampling
    logprobs: int | None = None
    """Also return the sampled token's log-probability and this many top alternatives."""
    min_tokens: int = 0
    """Until this many tokens are out, its ends of sequence (the request's `eos_ids`) are banned."""


GREEDY = SamplingParams(Sampling(greedy=True))
"""A request that says nothing of sampling."""


@dataclass
class Draws:
    """A sequence's state of sampling (its Sequence's `draws`): its own generator, seeded from
    its request's seed at its first draw, and under structured output its place in its grammar,
    advanced by each token it takes (the sequence ends, "stop", when the grammar is terminated)."""
    generator: torch.Generator | None = None
    grammar: Matcher | None = None


def request_sampling(temperature: float, top_p: float, top_k: int | None, seed: int | None,
                     logprobs: int | None = None) -> SamplingParams:
    """OpenAI's basic fields as a request's sampling: temperature 0 is greedy."""
    return seeded(openai_sampling(temperature=temperature, top_p=top_p, top_k=top_k), seed, logprobs)


def openai_sampling(*, temperature: float, top_p: float = 1.0, top_k: int | None = None, **fields) -> Sampling:
    """A `Sampling` from OpenAI's and vLLM's field values: temperature 0 is greedy, top_k
    None no cut; `fields`: the others by their `Sampling` names (min_p, penalties, logit_bias)."""
    return Sampling(greedy=temperature == 0, temperature=temperature or 1.0, top_k=top_k or 0, top_p=top_p, **fields)


def seeded(sampling: Sampling, seed: int | None, logprobs: int | None = None, min_tokens: int = 0) -> SamplingParams:
    """`sampling` with `seed` (None: a random one) as a request's."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    return SamplingParams(dataclasses.replace(sampling, seed=seed), logprobs, min_tokens)


def _draws(seq: Sequence, params: SamplingParams) -> Draws:
    """The sequence's sampling state, started at its first draw."""
    if seq.draws is None:
        seq.draws = Draws()
    if seq.draws.generator is None:
        seq.draws.generator = params.sampling.generator()
    return seq.draws


@dataclass(frozen=True)
class TokenEvent:
    seq: Sequence
    token: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    """This request's sampling failed (it alone is ended; token is None)."""
    prompt_logprobs: list[PromptScore] | None = None
    """With the first token of a sequence that asked: its prompt tokens' scores (1 .. len - 1)."""


@dataclass(frozen=True)
class Forward:
    """One forward of a step, as plain data (what rank 0 would send the other ranks): the token
    ids, the cache's view of each chunk, and which tokens' logits are read (the last of each
    sampling chunk), by index into `ids`."""
    ids: list[int]
    layouts: list[ChunkLayout]
    read_at: list[int]


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
        ids, layouts, read_at = [], [], []
        for chunk in chunks:
            first = len(ids)
            ids += chunk.ids
            layouts.append(ChunkLayout(chunk.seq.block_table, chunk.start, chunk.length))
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
        forwards.append(Forward(ids, layouts, read_at))
        rows += len(read_at)
    return forwards, reads


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """(batch, seq, vocab) logits, a vocabulary-sharded DTensor under tensor parallelism, as a
    plain fp32 tensor (batch * seq, vocab) on the CPU."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return logits.reshape(-1, logits.shape[-1]).float().cpu()


class Engine:
    def __init__(self, model: torch.nn.Module, scheduler: Scheduler, device: torch.device | str = "cpu",
                 on_logits: Callable[[Sequence, torch.Tensor], None] | None = None, channel=None,
                 expert_ranks: int = 1):
        """`on_logits(seq, logits)` sees the logits (vocab,) each token was picked from (tests).
        `channel`: rank 0's `rank_loop.RankChannel` under a parallel layout (the other ranks
        run the same forwards). `expert_ranks`: the ep degree (the ranks expert loads are
        counted over)."""
        self.model, self.scheduler, self.device = model.eval(), scheduler, torch.device(device)
        self.on_logits, self.channel = on_logits, channel
        self.expert_loads = ExpertLoads(model, expert_ranks)
        self.prompt_scores = PromptScores()
        self.cache = self.new_cache(scheduler.blocks.num_blocks, scheduler.block_size)
        self.steps = 0

    def new_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """Ragged attention (per sequence, over exactly its keys: `paged_attention.py`) unless
        latent attention's absorbed form needs the padded keys and their mask; decodes read
        straight from the pool on the CPU in float32 (`cpu_ops/decode_kernel.py`)."""
        cfg = getattr(self.model, "cfg", None)
        ragged = not getattr(cfg, "is_latent", False)
        dtype = next(self.model.parameters()).dtype
        return PagedKVCache(num_blocks, block_size, self.device, ragged=ragged,
                            pool_kernel=ragged and cpu_decode_kernel.usable(self.device, dtype))

    def forward(self, step: Step) -> tuple[torch.Tensor, Reads]:
        """The logits (rows read, vocab) of a scheduled step, and what each row is read for."""
        forwards, reads = step_forwards(step)
        if self.channel is not None:
            self.channel.send(forwards)
        return torch.cat([self.run_model(forward) for forward in forwards]), reads

    @torch.no_grad()
    def run_model(self, forward: Forward) -> torch.Tensor:
        """What every rank of a parallel layout runs with the same arguments (its forwards are
        collective): the tokens through the model, the logits (len(read_at), vocab)."""
        self.cache.prepare(forward.layouts)
        shape = self.cache.batch_shape()  # (sequences, 1) for decodes, (1, tokens) packed
        tokens = torch.tensor(forward.ids, dtype=torch.long, device=self.device).view(shape)
        read = torch.tensor(forward.read_at, dtype=torch.long, device=self.device)
        if shape[1] == 1:
            return full_logits(self.model(tokens, self.cache))[read]  # (rows read, vocab)
        return full_logits(self.model(tokens, self.cache, read_at=read))

    def run_order(self, forwards: list[Forward]) -> None:
        """A rank other than 0: run the forwards rank 0 sent (`rank_loop.follow`)."""
        for forward in forwards:
            self.run_model(forward)

    def close(self) -> None:
        """Stop the other ranks, if any."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def take_expert_rows(self) -> list[list[int]] | None:
        """Routed rows per rank of each MoE layer since the last call (None without MoE)."""
        return self.expert_loads.take()

    def step(self) -> list[TokenEvent]:
        """Schedule, run the model, sample; the new tokens (with the finished sequences)."""
        step = self.scheduler.schedule()
        if not step.chunks:
            return []
        logits, reads = self.forward(step)
        self.steps += 1
        return self.sample(self.scheduler, step, logits, reads)

    def sample(self, scheduler: Scheduler, step: Step, logits: torch.Tensor, reads: Reads) -> list[TokenEvent]:
        """A token for each sampling chunk from its logits row (the batch sampler, every row at
        once but the seeded draws), prompt tokens scored where asked, then `scheduler` closes
        the step."""
        read = logits  # every row the step read, guesses' rows included
        if reads.prompt:
            self.prompt_scores.add(logits[reads.prompt_rows], reads.prompt)
        if reads.prompt or any(reads.guess_rows):
            logits = logits[reads.sample_rows]
        sampling_chunks = reads.chunks
        asked: list[SamplingParams] = [chunk.seq.request.params or GREEDY for chunk in sampling_chunks]
        draws = [_draws(chunk.seq, a) for chunk, a in zip(sampling_chunks, asked)]
        if self.on_logits is not None:
            for row, chunk in zip(logits, sampling_chunks):
                self.on_logits(chunk.seq, row)
        rows = [Row(a.sampling, d.generator, chunk.seq.prompt, chunk.seq.output,
                    chunk.seq.eos_ids if len(chunk.seq.output) < a.min_tokens else frozenset(), d.grammar)
                for a, d, chunk in zip(asked, draws, sampling_chunks)]
        tokens, errors = _sample_rows(logits, rows)
        ended = _advance_grammars(draws, tokens, errors)
        logprobs: list[float | None] = [None] * len(asked)
        tops: list[list[tuple[int, float]] | None] = [None] * len(asked)
        wanted = [index for index, a in enumerate(asked) if a.logprobs is not None and index not in errors]
        if wanted:
            chosen, best = token_logprobs(logits[wanted], [tokens[i] for i in wanted], [asked[i].logprobs for i in wanted])
            for index, logprob, top in zip(wanted, chosen, best):
                logprobs[index], tops[index] = logprob, top
        for index in errors:
            scheduler.abort(sampling_chunks[index].seq, "error")  # finish_step passes over it
        sampled: dict[int, int | list[int]] = {
            id(chunk.seq): token for chunk, token in zip(sampling_chunks, tokens) if token is not None}
        for index, guess_rows in enumerate(reads.guess_rows):
            if guess_rows and tokens[index] is not None:
                chunk = sampling_chunks[index]
                sampled[id(chunk.seq)] = kept_and_next(read, chunk, tokens[index], guess_rows, asked[index],
                                                       draws[index].generator)
        lengths = [len(chunk.seq.tokens) for chunk in sampling_chunks]
        finished = {id(seq) for seq in scheduler.finish_step(step, sampled)}
        for index in ended:  # the grammar is complete: the answer is too
            seq = sampling_chunks[index].seq
            if id(seq) not in finished and seq in scheduler.running:
                scheduler.finish(seq, "stop")
                finished.add(id(seq))
        events = []
        for index, (chunk, token, logprob, top) in enumerate(zip(sampling_chunks, tokens, logprobs, tops)):
            seq = chunk.seq
            new = [None] if token is None else seq.tokens[lengths[index]:]
            for place, kept in enumerate(new):  # one token, or with guesses the kept ones and the next
                first, last = place == 0, place == len(new) - 1
                events.append(TokenEvent(seq, kept, logprob if first else None, top if first else None,
                                         seq.finish_reason if last and id(seq) in finished else None,
                                         errors.get(index) if first else None,
                                         self.prompt_scores.take(seq) if first and lengths[index] == len(seq.prompt)
                                         and token is not None else None))
        self.prompt_scores.forget_finished()
        return events


def _advance_grammars(draws: list[Draws], tokens: list[int | None], errors: dict[int, str]) -> list[int]:
    """Each constrained row's grammar advanced by its new token; the rows whose grammar is now
    terminated. A token the grammar refuses (only when nothing was left to allow, e.g. its end
    banned by `min_tokens`) fails that request alone, as a sampling error does."""
    ended = []
    for index, (d, token) in enumerate(zip(draws, tokens)):
        if d.grammar is None or token is None:
            continue
        if not d.grammar.accept(token):
            tokens[index] = None
            errors[index] = (f"structured output: the grammar allows no token here (token {token} was the "
                             "likeliest left; is min_tokens longer than the grammar lets the answer be?)")
        elif d.grammar.terminated:
            ended.append(index)
    return ended


def _sample_rows(logits: torch.Tensor, rows: list[Row]) -> tuple[list[int | None], dict[int, str]]:
    """Every row's token from one batched draw; if the batch fails, row by row, so that what one
    request's settings make the sampler do fails that request alone (its token None, its error
    by row index)."""
    try:
        return sample(logits, rows), {}
    except (RuntimeError, ValueError):
        pass
    tokens: list[int | None] = []
    errors: dict[int, str] = {}
    for index, row in enumerate(rows):
        try:
            tokens.append(sample(logits[index:index + 1], [row])[0])
        except (RuntimeError, ValueError) as error:
            tokens.append(None)
            errors[index] = f"sampling failed for this request: {str(error).splitlines()[0]}"
    return tokens, errors
