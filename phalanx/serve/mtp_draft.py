"""The draft step of speculative decoding by DeepSeek-V3's multi-token-prediction (MTP) layer
(`--speculative-config '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'`).

After every engine step (the model ran, the tokens were drawn and the scheduler took them),
the MTP layer (`model/multi_token_prediction.py`) runs once over every position the step made
final, of every sequence (those that never guess and those that just ended too: their blocks
may be found in the prefix cache by a later request, which then reads this layer's keys as
well, and their blocks are not handed out again before the next step is scheduled, after
this): at position i it reads the model's final-normed
hidden state there (the model runner keeps them, `ModelRunner.keep_hidden`) and the embedding
of the token at i + 1, which is now known (the prompt's next token, a guess the model kept, or
the token just drawn). Its keys go into the paged cache under the layer's own number, in the
same block pool and through the same block tables as the model's layers: position i of the MTP
layer is final exactly when position i of the model is (the kept positions; a rejected guess's
position is never fed to it), so the scheduler's accounting (blocks, preemption, prefix
caching) covers it unchanged, and the pool is sized for one more layer (`serve/loading.py`).
At the last position of a sequence that drew a token, its most likely token is the first
draft (`Sequence.drafted`), the token after the next one; with num_speculative_tokens k > 1
the layer runs again one position on, k - 1 times, on its own output (`_chain`). The next step
feeds the drafts as its guesses and keeps each only if the model itself draws it
(`speculative.py`), so what is served stays the model's own, greedy or seeded.

One difference from the model's own cache: a prefix-cached block holds the MTP keys that were
computed with the token after the block's last position as it was then, which a later
sequence sharing the block may continue otherwise; that changes one position's key of its
draft, never its output. As vLLM (vllm/v1/spec_decode/eagle.py), the draft is greedy.
"""

from __future__ import annotations

import torch

from phalanx.scheduling.scheduler import Scheduler, Step
from phalanx.serve.input_batch import StepMessage
from phalanx.serve.model_runner import ModelRunner
from phalanx.serve.paged_cache import ChunkLayout


class MtpDraft:
    def __init__(self, mtp: torch.nn.Module, runner: ModelRunner, tokens: int = 1):
        """`mtp`: a `MultiTokenPrediction` of the runner's model, on its device, in its dtype;
        `tokens`: how many it drafts a step (num_speculative_tokens)."""
        self.mtp, self.runner, self.model, self.tokens = mtp.eval(), runner, runner.model, tokens
        runner.keep_hidden = True

    @torch.no_grad()
    def after_step(self, step: Step, message: StepMessage, scheduler: Scheduler) -> None:
        """The MTP layer over the positions `step` made final (its keys cached), and a draft
        for every running sequence that may guess and whose next step feeds its last token
        (`Sequence.drafted`): one that drew a token, or whose prompt has one token left (the
        draft at the position before it is then the guess after it)."""
        where = self._where(message)
        running = {id(seq) for seq in scheduler.running}
        layouts, hidden, next_ids, read, drafting = [], [], [], [], []
        tokens = 0
        for chunk in step.chunks:
            seq = chunk.seq
            seq.drafted = ()
            # The chunk's positions kept (rejected guesses are not; none if aborted while the step ran).
            final = seq.num_computed - chunk.start
            if final <= 0:
                continue
            forward, offset = where[seq.serial]
            hidden.append(self.runner.hidden[forward][offset:offset + final])  # (final, dim)
            next_ids += seq.tokens[chunk.start + 1:chunk.start + final + 1]  # t_{i+1} for each position i
            layouts.append(ChunkLayout(self.runner.tables[seq.serial], chunk.start, final))
            tokens += final
            # Running, all but its last token computed (it feeds that next), and its requests check guesses.
            if seq.may_speculate and id(seq) in running and seq.num_computed == len(seq.tokens) - 1:
                read.append(tokens - 1)
                drafting.append(seq)
        if not layouts:
            return
        cache = self.runner.cache
        cache.prepare(layouts)
        shape = cache.batch_shape()  # (sequences, 1) when every chunk kept one position, else (1, tokens) packed
        ids = torch.tensor(next_ids, dtype=torch.long, device=self.runner.device).view(shape)
        h = torch.cat(hidden).view(*shape, -1)  # (batch, seq, dim)
        out = self.mtp(h, self.model.tok_embeddings(ids), self.model.rope, cache)  # (batch, seq, dim)
        if not drafting:
            return
        rows = out.reshape(-1, out.shape[-1])[torch.tensor(read, device=out.device)]  # (drafting, dim)
        for seq, token in zip(drafting, self.mtp.logits(rows).argmax(-1).tolist()):
            seq.drafted = (token,)
        self._chain(drafting, rows, scheduler)

    def _chain(self, drafting: list, rows: torch.Tensor, scheduler: Scheduler) -> None:
        """Drafts 2..k: the layer again at the next position, on its own output there and the
        token it just drafted (as vLLM applies its one MTP layer k times). Its key at that
        position goes where the next step writes the sequence's (its blocks taken a step early:
        `Scheduler.reserve`), and is overwritten when that position becomes final."""
        config = scheduler.speculative
        if config is not None and config.disable_by_batch_size is not None and (
                len(scheduler.running) + len(scheduler.waiting) > config.disable_by_batch_size):
            return  # the scheduler guesses nothing now: one draft is all it would keep
        for depth in range(1, self.tokens):
            # The position of the last draft: the last token's is num_computed, its first draft's one after.
            chained = [i for i, seq in enumerate(drafting) if len(seq.output) + depth + 1 < seq.max_tokens  # a guess it may still keep
                       and scheduler.reserve(seq, seq.num_computed + depth)]
            if not chained:
                return
            seqs = [drafting[i] for i in chained]
            cache = self.runner.cache
            cache.prepare([ChunkLayout(seq.block_table, seq.num_computed - 1 + depth, 1) for seq in seqs])
            ids = torch.tensor([seq.drafted[-1] for seq in seqs], dtype=torch.long, device=rows.device)[:, None]
            h = rows[torch.tensor(chained, device=rows.device)][:, None]  # (sequences, 1, dim)
            rows = self.mtp(h, self.model.tok_embeddings(ids), self.model.rope, cache)[:, 0]  # (sequences, dim)
            for seq, token in zip(seqs, self.mtp.logits(rows).argmax(-1).tolist()):
                seq.drafted += (token,)
            drafting = seqs

    @staticmethod
    def _where(message: StepMessage) -> dict[int, tuple[int, int]]:
        """Sequence serial -> (its forward's index, where its ids start in that forward)."""
        where = {}
        for index, forward in enumerate(message.forwards):
            offset = 0
            for serial, _, length in forward.chunks:
                where[serial] = (index, offset)
                offset += length
        return where
