"""Expert slots in serving plans: the load skew a plan is priced for (`--expert-load
FILE|zipf:S`), the slot counts the search tries, and the imbalance a placement leaves.

The imbalance is the balancer's own (`phalanx balance`, phalanx/balance/): for S slots over
ep ranks it places the slots for the given per-expert loads (replicating hot experts, no rank
holding two replicas of one) and predicts (max - mean) / mean of the ranks' routed rows
(TensorRT-LLM's imbalance ratio), averaged over the load's layers. The rank with the most
rows sets an MoE layer's time (every ep rank waits for the slowest in the combine), so the
step model charges the routed experts' rows and the dispatch and combine bytes at 1 +
imbalance times the mean (serve/step.py).

Without `--expert-load` every expert is equally hot: with one slot per expert and ep dividing
the experts the imbalance is 0 (every rank priced as the average one, as before slots); with S
slots that ep divides but the experts do not (SGLang's 288 slots for 256 experts on 72 GPUs)
it is what the placement's whole slots leave (0.125 there: a rank of four unreplicated experts
carries 4 where the mean is 256 / 72 = 3.56).

numpy is imported only when a plan has ep > 1 on an MoE model (`phalanx plan` stays light).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from phalanx.errors import UserError

ZIPF_LARGEST = 4.0
"""The largest Zipf exponent taken: at s = 4 the hottest expert already carries 92% of the
load (1 / zeta(4)); larger values are typos, not workloads."""


@dataclass(frozen=True)
class ExpertLoad:
    """Per-layer routed tokens of each expert (relative; only ratios matter), and its name as
    the user gave it (`zipf:1.2` or the file)."""
    name: str
    rows: tuple[tuple[float, ...], ...]
    """(layers, experts)."""
    path: str = ""
    """The file it was read from, where it has a row per MoE layer of the model ("" otherwise,
    and for zipf): `phalanx serve --expert-placement` then starts from its placement."""

    @property
    def experts(self) -> int:
        return len(self.rows[0])


def zipf_load(exponent: float, experts: int) -> ExpertLoad:
    """One layer whose i-th hottest expert carries 1 / i^s of the load (s = 0: even)."""
    return ExpertLoad(f"zipf:{exponent:g}", (tuple(1.0 / (i + 1) ** exponent for i in range(experts)),))


def parse_expert_load(text: str | None, *, n_experts: int, model: str, moe_layers: int = 0) -> ExpertLoad | None:
    """`--expert-load FILE|zipf:S` for a model of `n_experts` routed experts in `moe_layers` MoE
    layers; None: even loads. A file of any number of layers prices their mean imbalance; only
    one of the model's own layer count can also seed `phalanx serve --expert-placement`."""
    if text is None:
        return None
    if not n_experts:
        raise UserError(f"--expert-load {text}: model {model!r} has no routed experts")
    if text.startswith("zipf:"):
        raw = text[len("zipf:"):]
        try:
            exponent = float(raw)
        except ValueError:
            raise UserError(f"--expert-load {text}: zipf:S takes a number S >= 0 (the skew's exponent)") from None
        if not (0.0 <= exponent <= ZIPF_LARGEST):
            raise UserError(f"--expert-load {text}: the zipf exponent must be within 0 and {ZIPF_LARGEST:g} "
                            "(0 is even loads; at 4 one expert carries 92% of the tokens)")
        return zipf_load(exponent, n_experts)
    from phalanx.balance.loads import read_load  # numpy: only when a file is given
    from phalanx.balance.solve import check_load

    try:
        table = check_load(read_load(text))
    except UserError as error:  # the balancer's own message, said of this flag
        raise UserError(f"--expert-load {text}: {error}") from None
    if table.shape[1] != n_experts:
        raise UserError(f"--expert-load {text}: {table.shape[1]} experts per layer, but model {model!r} routes "
                        f"over {n_experts}")
    if not table.shape[0] or not table.sum():
        raise UserError(f"--expert-load {text}: no expert carries any load")
    return ExpertLoad(text, tuple(tuple(float(x) for x in row) for row in table),
                      path=text if table.shape[0] == moe_layers else "")


def slot_choices(n_experts: int, ep: int, load: ExpertLoad | None) -> list[int]:
    """Slot counts S (per MoE layer, over the ep group) the search tries at one ep: the fewest
    whole slots per rank that hold every expert (E itself where ep divides it), and, under a
    skew, one more per rank (room for the hot experts' replicas). Even loads gain nothing from
    more slots than that: they only add weights to read."""
    if not n_experts or ep == 1:
        return [n_experts]
    least = math.ceil(n_experts / ep) * ep
    return [least, least + ep] if load is not None else [least]


def expected_imbalance(load: ExpertLoad | None, *, n_experts: int, slots: int, ep: int) -> float:
    """The balancer's (max - mean) / mean of the routed rows over the ep ranks for `slots` slots
    placed for `load` (mean over its layers); 0 where nothing can be uneven."""
    if ep <= 1 or not n_experts:
        return 0.0
    if load is None:
        if slots == n_experts and n_experts % ep == 0:
            return 0.0  # even loads, whole experts per rank
        load = zipf_load(0.0, n_experts)
    return _balancer_imbalance(load, slots, ep)


@functools.lru_cache(maxsize=512)
def _balancer_imbalance(load: ExpertLoad, slots: int, ep: int) -> float:
    # Imported when run, not at the top: they bring in numpy, which `phalanx plan` on a dense
    # model need not wait for.
    import numpy as np

    from phalanx.balance import measure
    from phalanx.balance.solve import rebalance

    table = np.asarray(load.rows, dtype=float)
    placed = rebalance(table, slots, 1, 1, ep, policy="global").phy2log
    return float(measure.imbalance(measure.gpu_loads(table, placed, ep)).mean())
