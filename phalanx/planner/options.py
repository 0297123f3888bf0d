"""What the planner assumes about the training implementation, apart from layout and cluster.

`Options()` is the published runs' implementation (Megatron-style mixed precision, fused
kernels); `trainer_options` is a phalanx training run's. A module of its own because every part
of the cost and memory model reads it (stage_time, dp_traffic, peak_memory, cost), and none of
them should have to import the step-time model that sits on top of them to name its type.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.errors import UserError
from phalanx.planner.hardware import Cluster
from phalanx.planner.memory import MIXED_ADAM, TRAINER_PRECISION, Precision


@dataclass(frozen=True, kw_only=True)
class Options:
    """Properties of the training implementation rather than of the layout or the cluster."""

    flash_attention: bool = True
    """Fused attention: no s x s score matrix is stored."""
    tp_overlap: bool = False
    """TP collectives pipelined with their GEMMs (Megatron's tp-comm-overlap); phalanx does not."""
    dp_overlap: bool = True
    """Data-parallel traffic overlapped with the last backward and the first forward."""
    grad_reduce_bytes: int = 4
    """Gradients are reduced in fp32."""
    split_backward_recompute: bool = True
    """Under zbv (PyTorch's stage_backward_input, then stage_backward_weight) a checkpointed
    block's forward runs again for the input gradient and once more for each of its weight
    tensors' gradients: every weight gradient is a separate autograd call and checkpointing
    frees what it recomputed after each (measured: a dense SwiGLU block, 9 weight tensors, ran
    its forward 11 times per micro-batch; a tiny-model zbv step went from 62 to 174 ms with
    recompute=full, 1f1b from 32 to 54 ms). dualpipev runs measured no such cost, so it is
    charged to zbv only."""
    recompute_regathers: bool = False
    """Under zero 3, the recompute forward all-gathers the checkpointed layers' parameters once
    more (DeepSpeed ZeRO-3, whose hooks sit on every submodule). False: FSDP2 around the
    checkpointed block (phalanx's order, parallel/apply.py; torchtitan's) re-runs the forward
    inside the unit's backward, after its gather: with torch 2.13, 3 checkpointed blocks on 2
    processes gather 6 times per step with recompute as without
    (tests/test_planner_fsdp_gathers.py counts them)."""
    sp_regather: bool = False
    """Sequence parallelism keeps the attention and MLP inputs sharded and all-gathers them again
    in backward for the weight gradients (Megatron, the published activation formula, and the
    phalanx trainer: parallel/sequence_parallel.py). False: it keeps the gathered inputs whole,
    more memory and no second gather (DTensor's PrepareModuleInput alone)."""
    tp_splits_experts: bool = False
    """Tensor parallelism splits each expert's matrices too (Megatron). False: the MoE block stays
    out of tp, so every tp rank runs the same experts on the same tokens (the phalanx trainer
    until the expert-parallel training issue; the time model charges that duplicated work)."""
    reduce_each_microbatch: bool = False
    """Under zero 2 and 3 without pp, every micro-batch's backward reduce-scatters its gradients
    into the shards, which accumulate sharded (FSDP1 used without `no_sync`: Composer's
    `ddp_sync_context` only applies `no_sync` to a DistributedDataParallel model, so its FSDP
    runs sync every micro-batch). False: gradient sync off for all but the last micro-batch,
    the fp32 gradients accumulating unsharded (the phalanx trainer)."""
    precision: Precision = MIXED_ADAM
    """Bytes of weights, gradients, optimizer state, activations and logits
    (`memory.TRAINER_PRECISION[dtype]` for the phalanx trainer)."""
    fp32_compute: bool = False
    """The run computes in fp32: Megatron-LM and Megatron-DeepSpeed given neither --fp16 nor
    --bf16 (their `params_dtype` defaults to torch.float). Its GEMMs and attention run at the
    device's fp32 peak (`Cluster.fp32_tflops`), and its activations, attention scores,
    tensor-parallel collectives and pipeline sends move 4 bytes per element, not 2. False:
    16-bit compute (the published mixed-precision runs; the phalanx trainer, whose fp32 runs
    on CPUs are priced from calibrate's measurements)."""
    fused_norm: bool = True
    """RMSNorm saves only its input and 1/rms per row (torch's `_fused_rms_norm` on CUDA; Apex and
    Transformer Engine likewise; the phalanx trainer's model/rms_norm.py on every device). False:
    torch's CPU `rms_norm`, a composite of pow, mean, rsqrt and two multiplies, whose weight
    multiply also saves the normalized x/rms, one more s x b x h tensor per norm."""
    phalanx_trainer: bool = False
    """What phalanx's model and trainer keep beyond the reference implementations of the
    published runs (each measured or read off PyTorch, see `memory.layer_activation_bytes` and
    peak_memory.py): no dropout masks, the norms' and flash attention's small fp32 row
    statistics; torch DDP's reducer buckets, a second copy of the gradients
    (`gradient_as_bucket_view=False`)."""
    pp_partitioned_sends: bool = False
    """Each tp rank sends only its 1/tp of a stage boundary's activation (and of its gradient)
    and the next stage all-gathers it inside its node: DeepSpeed's PipelineEngine with
    `pipe_partitioned` (its default under model parallelism, PartitionedTensor) and Megatron's
    scatter_gather_tensors_in_pipeline. The all-gather runs on the fast links and is not
    charged. False: every tp rank sends the whole activation (the phalanx trainer), unless
    sequence parallelism already shards it."""
    cp_overlap: bool = False
    """Context parallelism passes key/value blocks around a ring while attention runs on the
    blocks at hand (Megatron-Core's, torchtitan's, the phalanx trainer's cp_ring=true, which the
    search then gives every cp layout), so attention compute hides the transfer where it is
    longer (`stage_time.cp_exposed`). False: the keys and values are all-gathered before
    attention needs them, on the critical path (Llama 3's choice, paper section 3.3.2), and
    their gradients reduce-scattered after; the phalanx trainer (`phalanx_trainer`) hides them
    behind each chunk's diagonal block only (`stage_time.trainer_cp_hidden`), or runs the ring
    where a layout's plan says cp_ring=true (the search tries both)."""
    expert_slots: int = 0
    """The trainer's `--expert-slots S` (docs/expert_slots.md): each ep rank holds S / ep expert
    slots, replicas of hot experts included, with their gradients and optimizer state, instead of
    n_experts / ep experts. 0: one slot per expert, and none of the slots' layout rules (S =
    n_experts, for `--rebalance-every` alone, keeps the memory and applies the rules: ep > 1,
    no tp or pp, `layout_rules.expert_slots_layout_problem`)."""


def activation_bytes(options: Options) -> int:
    """Bytes of one activation element as computed and communicated (`fp32_compute`)."""
    return 4 if options.fp32_compute else 2


def trainer_options(dtype: str, cluster: Cluster, **overrides) -> Options:
    """Options of a phalanx training run (`phalanx train --plan auto`, `phalanx plan` without
    --any-runtime), as opposed to the published implementations' defaults of `Options()`:
    the trainer keeps fp32 weights and AdamW's two fp32 moments, 16 bytes per parameter with its
    fp32 gradient (memory.TRAINER_PRECISION[dtype]), its own model's tensors
    (`phalanx_trainer`), its RMSNorm saving input and rstd only (`fused_norm`), sequence
    parallelism keeping shards (`sp_regather`), and
    MoE blocks left out of tp (`tp_splits_experts=False`). Whether tp ranks then repeat the
    expert work (the default) or split its rows (`ep_over_tp=true`, MoE parallel folding) is
    the layout's plan key, which the cost and memory models read (`peak_memory.folds_experts`):
    folded, routed expert GEMMs, all-to-all bytes and activations per device are divided by tp,
    experts per device are n_experts / ep with ep over dp x tp, and an all-gather of the rows
    over tp is charged forward and backward. `expert_slots` (overrides): the run's
    --expert-slots (`Options.expert_slots`)."""
    if dtype not in TRAINER_PRECISION:
        raise UserError(f"dtype={dtype!r} must be one of {', '.join(TRAINER_PRECISION)}")
    kw = dict(precision=TRAINER_PRECISION[dtype], phalanx_trainer=True, fused_norm=True, sp_regather=True,
              tp_splits_experts=False)
    return Options(**{**kw, **overrides})
