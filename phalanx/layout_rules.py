"""The rules of a parallel layout, in one torch-free place.

Each function answers one question about a layout against a model's shape and returns the
reason it fails ("" when it does not), so that the planner's search, its `--fix` messages, the
`Plan` checks and `parallel/` (run by the launcher before any worker starts) say the same thing
in the same words. Shapes are passed as plain integers: importing this needs neither torch nor
the model code. `model`, where given, names the model in the message.
"""

from __future__ import annotations

import math

V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that place two chunks per rank in a V (the last stage's chunk on the first rank)."""
MULTI_CHUNK_SCHEDULES = ("interleaved", *V_SCHEDULES)
"""Schedules that hold more than one model chunk per rank (`virtual` of them)."""


def divisors(n: int) -> list[int]:
    """Every degree that splits `n` evenly, ascending: the counts a search over `n` devices (or
    experts, or slots) tries. The one definition the training and serving searches share."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _of(model: str) -> str:
    return f" of model {model!r}" if model else ""


def tp_problem(tp: int, *, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int,
               expert_ffn_dim: int = 0, n_experts: int = 0, padded: bool = False, model: str = "") -> str:
    """Why tensor parallelism of degree `tp` cannot split this shape.

    tp splits the attention heads, the feed-forward (and each expert's, where experts are
    split; pass n_experts=0 where they are not) hidden size and, in the phalanx trainer, the KV
    heads and the vocabulary evenly. `padded`: an implementation that replicates KV heads when
    tp exceeds them, and pads the vocabulary (Megatron), needs only that tp is a multiple of
    n_kv_heads or divides them, and nothing of the vocabulary.
    """
    if tp < 1:
        return f"tp={tp} must be at least 1"
    if tp == 1:
        return ""
    of = _of(model)
    if n_heads % tp:
        return f"tp={tp} must divide n_heads={n_heads}{of}"
    if padded:
        if n_kv_heads % tp and tp % n_kv_heads:
            return f"tp={tp} must divide n_kv_heads={n_kv_heads}{of} or be a multiple of it"
    elif n_kv_heads % tp:
        return f"tp={tp} must divide n_kv_heads={n_kv_heads}{of}"
    if ffn_dim % tp:
        return f"tp={tp} must divide ffn_dim={ffn_dim}{of}"
    if n_experts and expert_ffn_dim % tp:
        return f"tp={tp} must divide the experts' ffn_dim={expert_ffn_dim}{of}"
    if not padded and vocab_size % tp:
        return f"tp={tp} must divide vocab_size={vocab_size}{of}"
    return ""


def sp_problem(tp: int, *, seq_len: int) -> str:
    """Sequence parallelism splits each sequence over the tp ranks."""
    if seq_len % tp:
        return f"sp=true splits the sequence over tp={tp}, which must divide seq_len={seq_len}"
    return ""


def ep_dp_problem(ep: int, *, dp: int, tp: int = 1, over_tp: bool = False, cp: int = 1) -> str:
    """Expert parallelism is carved out of the data-parallel ranks (dp x cp of them: cp ranks
    hold different tokens, like dp ranks), or with ep_over_tp=true out of the dp x cp x tp ranks
    (MoE parallel folding, phalanx/parallel/expert_fold.py)."""
    if cp > 1 and not over_tp:
        if (dp * cp) % ep:
            return f"ep={ep} must divide dp x cp = {dp} x {cp} = {dp * cp} (experts are spread over the dp x cp ranks)"
        return ""
    if over_tp:
        if tp == 1 or ep == 1:
            return (f"ep_over_tp=true spreads experts over the tp ranks too and needs tp > 1 and ep > 1, "
                    f"got tp={tp}, ep={ep}")
        if (dp * cp * tp) % ep:
            ranks = f"dp x cp x tp = {dp} x {cp} x {tp} = {dp * cp * tp}" if cp > 1 else f"dp x tp = {dp * tp}"
            return f"ep={ep} must divide {ranks} (ep_over_tp=true spreads experts over those ranks)"
        return ""
    if dp % ep:
        return f"ep={ep} must divide dp={dp} (experts are spread over data-parallel ranks)"
    return ""


def ep_problem(ep: int, *, dp: int, n_experts: int, model: str = "", tp: int = 1, over_tp: bool = False) -> str:
    """Expert parallelism spreads whole experts over data-parallel ranks."""
    if ep == 1:
        return ""
    if not n_experts:
        return f"ep={ep} needs a mixture-of-experts model; {repr(model) if model else 'this one'} has no experts"
    if n_experts % ep:
        return (f"ep={ep} must divide the number of experts, n_experts={n_experts}{_of(model)} "
                f"({n_experts} / {ep} is not a whole number of experts per rank)")
    return ep_dp_problem(ep, dp=dp, tp=tp, over_tp=over_tp)


def runs_fsdp(dp: int, *, zero: int, tp: int, pp: int) -> bool:
    """Whether the trainer runs data parallelism as FSDP2: when asked (zero 2 or 3), and also
    for replicated data parallelism beside tp or pp (HSDP with shard size 1, which accepts
    DTensor parameters and pipeline stages where torch DDP does not)."""
    return dp > 1 and (zero >= 2 or tp > 1 or pp > 1)


def expert_slots_count_problem(slots: int, *, n_experts: int, model: str = "", flag: str = "") -> str:
    """Expert slots (`--expert-slots S`; S = n_experts for `--rebalance-every` alone) hold every
    expert at least once. `flag` names the setting in the message (default --expert-slots=S)."""
    flag = flag or f"--expert-slots={slots}"
    if not n_experts:
        return f"{flag} needs a mixture-of-experts model; {repr(model) if model else 'this one'} has no experts"
    if slots < n_experts:
        return f"--expert-slots={slots} is fewer slots than the {n_experts} experts{_of(model)}"
    return ""


def expert_slots_layout_problem(slots: int, *, ep: int | None, fsdp: bool, over_tp: bool, tp: int = 1, pp: int = 1,
                                edp: int | None = None, expert_shape: tuple[int, int] = (0, 0), offload: bool = False,
                                flag: str = "") -> str:
    """The layouts the trainer runs expert slots in: ep > 1, S a multiple of ep (S / ep slots per
    rank), not folded over tp, and neither tp nor pp (docs/expert_slots.md, "What is not done").
    Under FSDP (`runs_fsdp`) the experts are sharded over edp on a dim inside each slot (FSDP2
    `Shard(1)` or `Shard(2)`, evenly, which FSDP2 requires off dim 0), so every edp rank holds
    every local slot: edp must divide the experts' ffn_dim or the model dim (`expert_shape`,
    (ffn_dim, dim); (0, 0) or edp=None: not checked). Not with offload: the sharded slots and
    their gradients would live on the host, where the replica sum and the moves (collectives
    over the device's ep group) do not reach them. ep=None: not known yet (a planner `--fix`
    that leaves it free); its checks are skipped."""
    flag = flag or f"--expert-slots={slots}"
    if ep == 1:
        return f"{flag} needs expert parallelism (ep > 1 in --plan); with ep=1 every rank holds every expert"
    if over_tp:
        return (f"{flag} is not supported yet with ep_over_tp=true (folded tp ranks each route a slice "
                "of the rows); leave ep_over_tp out of --plan")
    if tp > 1 or pp > 1:
        return (f"{flag} is not supported yet beside tp or pp (got tp={tp}, pp={pp}); use data parallelism "
                "with ep, e.g. --plan dp=4,ep=4 or dp=4,ep=2,fsdp=true")
    if offload:
        return f"{flag} is not supported yet with offload=true (expert slots move and sum on the device)"
    if ep is not None and slots % ep:
        return (f"--expert-slots={slots} is not a multiple of ep={ep} "
                f"({slots} / {ep} is not a whole number of slots per rank)")
    if fsdp and edp and edp > 1 and any(expert_shape) and all(size % edp for size in expert_shape):
        hidden, dim = expert_shape
        return (f"{flag} under FSDP shards each expert slot over edp={edp}, which must divide the experts' "
                f"ffn_dim={hidden} or dim={dim}")
    return ""


def chunks_per_rank(schedule: str, pp: int, virtual: int) -> int:
    """Model chunks one pipeline rank holds: 1 (gpipe, 1f1b), `virtual` (interleaved), 2 (V)."""
    if pp == 1:
        return 1
    if schedule in V_SCHEDULES:
        return 2
    return virtual if schedule == "interleaved" else 1


def stages_of_rank(schedule: str, rank: int, pp: int, virtual: int) -> list[int]:
    """Virtual stages (model chunks in order) that pipeline rank `rank` holds.

    Looped placement (interleaved): rank r holds r, r + pp, r + 2 pp, ...; V placement (zbv,
    dualpipev): rank r holds r and 2 pp - 1 - r, so the first rank holds the last stage too.
    """
    if schedule in V_SCHEDULES and pp > 1:
        return [rank, 2 * pp - 1 - rank]
    return [rank + c * pp for c in range(chunks_per_rank(schedule, pp, virtual))]


def virtual_problem(schedule: str, *, pp: int, virtual: int) -> str:
    """Chunks per rank each schedule takes: interleaved at least 2, the V schedules exactly 2,
    gpipe and 1f1b one."""
    if schedule == "interleaved" and pp > 1 and virtual < 2:
        return "schedule=interleaved needs virtual >= 2"
    if schedule in V_SCHEDULES and pp > 1 and virtual != 2:
        return f"schedule={schedule} uses exactly virtual=2 (two chunks per rank, V shape)"
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        return f"schedule={schedule} runs one chunk per rank; virtual={virtual} needs interleaved"
    return ""


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches a schedule runs: every stage busy once (pp), DualPipe two per
    stage (its two directions), gpipe any number."""
    if pp == 1 or schedule == "gpipe":
        return 1
    return 2 * pp if schedule == "dualpipev" else pp


def microbatches_problem(schedule: str, *, pp: int, microbatches: int) -> str:
    """Too few micro-batches for the schedule to keep every stage busy."""
    need = min_microbatches(schedule, pp)
    if microbatches < need:
        return f"schedule={schedule} with pp={pp} needs microbatches >= {need}, got {microbatches}"
    return ""


def interleaved_rounds_problem(microbatches: int, pp: int) -> str:
    """Interleaved 1F1B runs micro-batches in rounds of about pp; the rounds must split them evenly."""
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        return (f"schedule=interleaved runs microbatches={microbatches} in {rounds} rounds of about pp={pp}; "
                f"use a count that splits evenly ({rounds * pp} or {(rounds + 1) * pp})")
    return ""


def pipeline_problem(schedule: str, *, pp: int, virtual: int, microbatches: int, n_layers: int,
                     model: str = "") -> str:
    """Why a pipeline schedule cannot run this many micro-batches over this many layers."""
    if pp == 1:
        return ""
    chunks = chunks_per_rank(schedule, pp, virtual)
    if pp * chunks > n_layers:
        whose = f"model {model!r}" if model else "the model"
        return (f"pp={pp} x virtual={chunks} = {pp * chunks} stages, but {whose} has {n_layers} layers "
                "(each stage needs one)")
    if problem := microbatches_problem(schedule, pp=pp, microbatches=microbatches):
        return problem
    if schedule == "interleaved":
        return interleaved_rounds_problem(microbatches, pp)
    return ""


def layers_per_rank(n_layers: int, pp: int, chunks: int) -> int:
    """Layers on the most loaded pipeline rank (chunks of ceil(L / (pp * chunks)) layers)."""
    return chunks * math.ceil(n_layers / (pp * chunks))


def cp_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of a sequence's 2 x cp equal chunks that context-parallel rank `rank` holds: i
    and 2cp-1-i, an early chunk (little causal work: few keys before it) with a late one
    (much), so every rank of the group does the same attention work (docs/layout.md)."""
    return rank, 2 * cp - 1 - rank


def cp_problem(cp: int, *, seq_len: int, tp: int = 1, sp: bool = False) -> str:
    """Context parallelism cuts each sequence into 2 x cp chunks (x tp with sp, whose norms
    then split each rank's part over the tp ranks)."""
    if cp == 1:
        return ""
    unit = 2 * cp * (tp if sp else 1)
    if seq_len % unit:
        spelled = f"2 x cp x tp = 2 x {cp} x {tp} = {unit} (cp={cp} with sp=true)" if sp else f"2 x cp = {unit} (cp={cp})"
        return f"seq_len={seq_len} must divide by {spelled}: each sequence is cut into {unit} equal chunks"
    return ""


def cp_ring_problem(cp_ring: bool, *, latent: bool, model: str) -> str:
    """The ring schedule passes per-head keys and values; latent attention gathers its
    compressed latents and decompresses them on each rank (only they travel)."""
    if cp_ring and latent:
        return (f"cp_ring=true does not run latent attention (model {model!r}): its cp ranks gather the compressed "
                "latents before decompressing them per head, so that only those travel; use cp_ring=false")
    return ""


def ring_step_pairs(seq_len: int, cp: int, rank: int, owner: int) -> int:
    """Query-key pairs under the causal mask between cp rank `rank`'s queries and rank
    `owner`'s keys: what one step of the ring schedule computes (parallel/context_parallel_ring.py).
    With the load-balanced chunks it is 2 chunk^2 for every owner but the rank itself, and
    chunk^2 + chunk (chunk + 1) for it: every step is the same work, to 1/chunk."""
    chunk = seq_len // (2 * cp)
    pairs = 0
    for c in cp_chunks(cp, rank):
        for k in cp_chunks(cp, owner):
            pairs += chunk * chunk if k < c else chunk * (chunk + 1) // 2 if k == c else 0
    return pairs


def causal_pairs(seq_len: int, cp: int, rank: int) -> int:
    """Query-key pairs under the causal mask that cp rank `rank` computes: position p sees the
    p + 1 keys 0..p (the load-balance test and the planner's attention work per rank)."""
    chunk = seq_len // (2 * cp)
    return sum(sum(p + 1 for p in range(c * chunk, (c + 1) * chunk)) for c in cp_chunks(cp, rank))
