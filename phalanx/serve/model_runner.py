"""One rank's model and paged KV cache: a step's message (`input_batch.StepMessage`) through
the model, the logits of the rows it reads.

Every rank of a parallel layout runs the same messages with the same arguments (its forwards
are collective), rank 0 included; only rank 0 keeps the logits, on the model's device. The model is the training
code's own `Transformer`, in whatever layout it was loaded (under tensor parallelism its
vocabulary-sharded logits are gathered with `full_tensor()`), and only the rows read are
projected onto the vocabulary. The block tables come from the runner's own copy, kept up to
date by each message's changes (`block_tables.py`).
"""

from __future__ import annotations

import torch

from phalanx.cpu_ops import decode_kernel as cpu_decode_kernel
from phalanx.serve.block_tables import BlockTables
from phalanx.serve.compiled_decode import compiled_decode
from phalanx.serve.input_batch import Forward, StepMessage
from phalanx.serve.paged_cache import ChunkLayout, PagedKVCache


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """(batch, seq, vocab) logits, a vocabulary-sharded DTensor under tensor parallelism, as a
    plain fp32 tensor (batch * seq, vocab) where they are: the step sampler works on the
    logits' device (`inference/sampling.py`), so on a GPU only the chosen ids come back to the
    host, not (rows, vocab) floats."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return logits.reshape(-1, logits.shape[-1]).float()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device | str, num_blocks: int, block_size: int,
                 compile: bool = False):
        """`compile`: decodes through one compiled graph where the model allows it
        (`compiled_decode.py`, `phalanx serve --compile`)."""
        self.model, self.device = model.eval(), torch.device(device)
        self.cache = self._new_cache(num_blocks, block_size)
        self.tables = BlockTables()
        self.compiled = compiled_decode(self.model, self.cache) if compile else None
        self.keep_hidden = False
        """Keep every position's final-normed hidden state (`hidden`): a draft model reads them
        (speculative decoding by multi-token prediction, mtp_draft.py)."""
        self.hidden: list[torch.Tensor] = []
        """With keep_hidden, per forward of the last message: (len(ids), dim), in the order of its ids."""

    def _new_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """Ragged attention (per sequence, over exactly its keys: `paged_attention.py`) unless
        latent attention's absorbed form needs the padded keys and their mask; decodes read
        straight from the pool on the CPU in float32 or bfloat16 (`cpu_ops/decode_kernel.py`)."""
        cfg = getattr(self.model, "cfg", None)
        ragged = not getattr(cfg, "is_latent", False)
        dtype = next(self.model.parameters()).dtype
        return PagedKVCache(num_blocks, block_size, self.device, ragged=ragged,
                            pool_kernel=ragged and cpu_decode_kernel.usable(self.device, dtype))

    def run_message(self, message: StepMessage) -> torch.Tensor:
        """The step's forwards, the logits (rows read, vocab) of all of them in order."""
        self.tables.apply(message.tables)
        self.hidden = []
        return torch.cat([self.run(forward) for forward in message.forwards])

    @torch.no_grad()
    def run(self, forward: Forward) -> torch.Tensor:
        """The tokens through the model, the logits (len(read_at), vocab)."""
        self.cache.prepare([ChunkLayout(self.tables[serial], start, length) for serial, start, length in forward.chunks])
        shape = self.cache.batch_shape()  # (sequences, 1) for decodes, (1, tokens) packed
        tokens = torch.tensor(forward.ids, dtype=torch.long, device=self.device).view(shape)
        read = torch.tensor(forward.read_at, dtype=torch.long, device=self.device)
        if self.keep_hidden:  # every position normed (rows alike: the same logits), the rows read projected
            hidden = self.model.norm(self.model.trunk(tokens, self.cache))
            self.hidden.append(hidden.reshape(-1, hidden.shape[-1]))  # (len(ids), dim)
            return full_logits(self.model.output(self.hidden[-1][read]))
        if shape[1] == 1:
            # The compiled step once every layer's pool exists (a first forward may be one-token prompts).
            step = self.compiled if self.compiled is not None and self.cache.pools else self.model
            return full_logits(step(tokens, self.cache))[read]  # (rows read, vocab)
        return full_logits(self.model(tokens, self.cache, read_at=read))
