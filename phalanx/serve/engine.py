"""One engine step: the scheduler's batch through the model, then a token for each sequence
whose chunk reached its end.

The step's chunks are packed into one batch row (1, tokens) (`paged_cache.py`); the model is
the training code's own `Transformer`, in whatever layout it was loaded (under tensor
parallelism its vocabulary-sharded logits are gathered with `full_tensor()`), and only the
last position of each sampling chunk is projected onto the vocabulary. Sampling reuses
`phalanx generate`'s `pick_token`, with one seeded generator per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from phalanx.inference.sampling import Sampling, pick_token
from phalanx.cpu_ops import decode_kernel as cpu_decode_kernel
from phalanx.serve.expert_loads import ExpertLoads
from phalanx.serve.paged_cache import ChunkLayout, PagedKVCache
from phalanx.scheduling.scheduler import Chunk, Scheduler, Sequence, Step


@dataclass
class RequestSampling:
    """What a request asked for; `sampling` is `phalanx generate`'s."""
    sampling: Sampling
    logprobs: int | None = None
    """Also return the sampled token's log-probability and this many top alternatives."""
    generator: torch.Generator = field(init=False)

    def __post_init__(self):
        self.generator = self.sampling.generator()


def request_sampling(temperature: float, top_p: float, top_k: int | None, seed: int | None,
                     logprobs: int | None = None) -> RequestSampling:
    """OpenAI's fields as a Sampling: temperature 0 is greedy; no seed draws a random one."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    return RequestSampling(Sampling(greedy=temperature == 0, temperature=temperature or 1.0, top_k=top_k or 0,
                                    top_p=top_p, seed=seed), logprobs)


@dataclass(frozen=True)
class TokenEvent:
    seq: Sequence
    token: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    """This request's sampling failed (it alone is ended; token is None)."""


@dataclass(frozen=True)
class Forward:
    """One forward of a step, as plain data (what rank 0 would send the other ranks): the token
    ids, the cache's view of each chunk, and which tokens' logits are read (the last of each
    sampling chunk), by index into `ids`."""
    ids: list[int]
    layouts: list[ChunkLayout]
    read_at: list[int]


def step_forwards(step: Step) -> tuple[list[Forward], list[Chunk]]:
    """The step as at most two forwards, decodes (one sequence per row) and prompt chunks
    (packed, paged_cache.py), and the sampling chunks in the order their logits come back."""
    groups = [[c for c in step.chunks if c.length == 1], [c for c in step.chunks if c.length > 1]]
    forwards, order = [], []
    for chunks in groups:
        if not chunks:
            continue
        ids, layouts, read_at = [], [], []
        for chunk in chunks:
            ids += chunk.seq.tokens[chunk.start:chunk.start + chunk.length]
            layouts.append(ChunkLayout(chunk.seq.block_table, chunk.start, chunk.length))
            if chunk.samples:
                read_at.append(len(ids) - 1)
                order.append(chunk)
        forwards.append(Forward(ids, layouts, read_at))
    return forwards, order


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

    def forward(self, step: Step) -> tuple[torch.Tensor, list[Chunk]]:
        """The logits (sampling chunks, vocab) of a scheduled step, and those chunks in order."""
        forwards, order = step_forwards(step)
        if self.channel is not None:
            self.channel.send(forwards)
        return torch.cat([self.run_model(forward) for forward in forwards]), order

    @torch.no_grad()
    def run_model(self, forward: Forward) -> torch.Tensor:
        """What every rank of a parallel layout runs with the same arguments (its forwards are
        collective): the tokens through the model, the logits (len(read_at), vocab)."""
        self.cache.prepare(forward.layouts)
        shape = self.cache.batch_shape()  # (sequences, 1) for decodes, (1, tokens) packed
        tokens = torch.tensor(forward.ids, dtype=torch.long, device=self.device).view(shape)
        read = torch.tensor(forward.read_at, dtype=torch.long, device=self.device)
        if shape[1] == 1:
            return full_logits(self.model(tokens, self.cache))[read]  # (sampling chunks, vocab)
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
        logits, sampling_chunks = self.forward(step)
        self.steps += 1
        return self.sample(self.scheduler, step, logits, sampling_chunks)

    def sample(self, scheduler: Scheduler, step: Step, logits: torch.Tensor, sampling_chunks: list[Chunk]) -> list[TokenEvent]:
        """A token for each sampling chunk from its logits row, then `scheduler` closes the step.
        Greedy rows and log-probabilities for all rows at once (one argmax and one log-softmax
        over the batch, each row's the same numbers as alone); a drawn token per row, with its
        request's generator."""
        asked: list[RequestSampling] = [chunk.seq.sampling for chunk in sampling_chunks]
        if self.on_logits is not None:
            for row, chunk in zip(logits, sampling_chunks):
                self.on_logits(chunk.seq, row)
        greedy = logits.argmax(-1).tolist() if any(a.sampling.greedy for a in asked) else []
        tokens: list[int | None] = []
        errors: dict[int, str] = {}
        for index, a in enumerate(asked):
            if a.sampling.greedy:
                tokens.append(greedy[index])
                continue
            try:  # what one request's settings make the sampler do fails that request alone
                tokens.append(pick_token(logits[index], a.sampling, a.generator))
            except (RuntimeError, ValueError) as error:
                tokens.append(None)
                errors[index] = f"sampling failed for this request: {str(error).splitlines()[0]}"
        logprobs: list[float | None] = [None] * len(asked)
        tops: list[list[tuple[int, float]] | None] = [None] * len(asked)
        wanted = [index for index, a in enumerate(asked) if a.logprobs is not None and index not in errors]
        if wanted:
            scores = torch.log_softmax(logits[wanted], -1)  # of the model's distribution, before temperature
            picked = scores.gather(1, torch.tensor([[tokens[i]] for i in wanted]))[:, 0].tolist()
            for row, (index, logprob) in enumerate(zip(wanted, picked)):
                logprobs[index], count = logprob, asked[index].logprobs
                values, ids = scores[row].topk(count) if count else (None, None)
                tops[index] = list(zip(ids.tolist(), values.tolist())) if count else []  # logprobs=0: none to list
        for index in errors:
            scheduler.abort(sampling_chunks[index].seq, "error")  # finish_step passes over it
        sampled = {id(chunk.seq): token for chunk, token in zip(sampling_chunks, tokens) if token is not None}
        finished = {id(seq) for seq in scheduler.finish_step(step, sampled)}
        return [TokenEvent(chunk.seq, token, logprob, top, chunk.seq.finish_reason if id(chunk.seq) in finished else None,
                           errors.get(index))
                for index, (chunk, token, logprob, top) in enumerate(zip(sampling_chunks, tokens, logprobs, tops))]
