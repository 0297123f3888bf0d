"""Context parallelism computes what one process computes, alone and beside dp, tp, pp, zero=3
and expert parallelism (over dp x cp, and folded over tp), with latent attention, `--compile`
and `--doc-mask` (through pipelines too); its checkpoints resume on other cp degrees.

Each layout trains for 2 AdamW steps on the same global batches (4 sequences of 32 tokens: a
chunk of cp=4 holds 4 positions, of cp=2 8) from the same weights and must match one process
in the loss of every step, the validation loss, the clipped-by gradient norm of every step and
every rank's copy of every weight, within 1e-4 (fp32). What legitimately differs is the order
of float additions: a rank's softmax runs over its keys in the gathered (rank, chunk) order
instead of position order, the key/value gradients are summed over the cp ranks by the
reduce-scatter, and gradients are averaged over dp x cp ranks; each is ~1e-7 relative per
operation (measured loss differences: below 1e-6). A wrong chunk (positions or mask off by one
chunk), a missing gradient sum over cp or a mean over the wrong ranks moves the losses and
weights by >1e-3 and fails; so does a rotary table read at local instead of absolute positions,
and so do another micro-batch's document ids under pp. `--compile` (aot_eager) runs the same
operations in the same order, decomposed, within the same bound.

Layouts of one world size run in one launch of forked gloo ranks, one after another.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from phalanx.errors import UserError
from phalanx.parallel.compile import BACKEND_ENV
from phalanx.testing.fork_ranks import run_ranks
from phalanx.testing.small_corpus import ONE_FILE_CORPUS
from phalanx.testing.weights import gathered_weights
from phalanx.train.config import TrainConfig
from phalanx.train.loop import train

TOLERANCE = 1e-4
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

LAYOUTS = {
    4: ["cp=4", "dp=2,cp=2", "tp=2,cp=2,sp=true", "docmask pp=2,cp=2,recompute=full", "dp=2,cp=2,zero=3",
        "tiny-dsv3 dp=2,cp=2,ep=4", "tiny-moe tp=2,cp=2,ep=4,ep_over_tp=true", "docmask cp=4,cp_ring=true",
        "tp=2,cp=2,sp=true,cp_ring=true"],
    2: ["cp=2", "resume cp=2", "compile docmask cp=2,recompute=full", "cp=2,recompute=selective",
        "compile cp=2,cp_ring=true,recompute=selective"],
}
"""A model name before the plan trains that model; "resume" continues the cp=4 run's step-1
checkpoint (the cp=4 layout saves one every step) on this plan; "docmask" trains with
`--doc-mask` on packed short documents (`_packed_documents`), here with full recomputation,
which gathers keys and values again in backward and needs the document ids there too (under
pp=2's 1f1b schedule, those of the micro-batch being recomputed, whose backward follows the
next micro-batch's forward on stage 0; the suite's pp=2 x cp=2 layout, the mask on top);
they also sample 4 tokens at the end, which every rank generates over the whole prompt (through
the pipeline with pp, where the sampling forwards step around cp's and the mask's view);
"compile" trains with `--compile` (aot_eager, as tests/test_compile.py's ranks: dynamo's capture
and AOT autograd's graphs without inductor's C++), whose blocks then hold the gather;
recompute=selective recomputes the attention core, whose op holds the gather, so it gathers
again in backward (every rank alike). cp_ring=true passes keys and values around the cp ranks
instead of gathering them (tests/test_context_parallel_ring.py tests its steps): over 3 hops
within documents at cp=4, beside tp (a cp group of ranks tp apart: the ring's neighbours are
global ranks 2 apart), and compiled and recomputed at cp=2.
tiny-dsv3 is latent attention (its cp ranks gather the latent and the rotated shared key) and
MoE with the learned routing bias, experts over dp x cp; tiny-moe with ep_over_tp folds the
experts over the dp x cp x tp ranks."""


def _dir(layout: str) -> str:
    return layout.replace(" ", "_").replace(",", "_").replace("=", "-") or "one"


def _settings(cfg: TrainConfig, layout: str) -> TrainConfig:
    *words, plan = layout.split(" ")
    module_dir = cfg.out
    cfg = cfg.replace(plan=plan, out=f"{cfg.out}/{_dir(layout)}")
    if plan == "cp=4":
        cfg = cfg.replace(ckpt_every=1)
    for word in words:
        if word == "compile":
            os.environ[BACKEND_ENV] = "aot_eager"  # in this forked rank only: tests/test_compile.py says why
            cfg = cfg.replace(compile=True)
        elif word == "docmask":
            cfg = cfg.replace(doc_mask=True, data=_packed_documents(module_dir), sample_tokens=4)
        else:
            cfg = cfg.replace(resume=True) if word == "resume" else cfg.replace(model=word)
    return cfg


def _packed_documents(module_dir: str) -> str:
    """A prepared directory of short documents (8 to 40 bytes: a 32-token window spans two or
    more), made once per module."""
    import random

    from phalanx.data.prepare import prepare

    base = Path(module_dir)
    target = base / "packed-data"
    if not target.exists():
        text, rng, docs = Path(ONE_FILE_CORPUS).read_text()[:30000], random.Random(0), []
        while text:
            cut = rng.randint(8, 40)
            docs.append(json.dumps({"text": text[:cut]}))
            text = text[cut:]
        (base / "docs.jsonl").write_text("\n".join(docs) + "\n")
        prepare([str(base / "docs.jsonl")], tokenizer="bytes", out=str(target), val_fraction=0.1, workers=1, progress=False)
    return str(target)


def _resume_dir(cfg: TrainConfig, layout: str) -> None:
    """The cp=4 run's folder without its step-2 checkpoint, as `layout`'s run folder (rank 0)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        target = Path(cfg.out) / _dir(layout)
        shutil.copytree(Path(cfg.out) / _dir("cp=4"), target, ignore=shutil.ignore_patterns("step_000002"))
        (target / "metrics.jsonl").unlink()
    if dist.is_initialized():
        dist.barrier()


def _train_layouts(cfg: TrainConfig, layouts: list[str]) -> dict:
    """On every rank: each layout's losses, validation loss and this rank's full weights."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    out = {}
    for layout in layouts:
        if layout.startswith("resume"):
            _resume_dir(cfg, layout)
        settings = _settings(cfg, layout)
        torch._dynamo.reset()  # a compiled layout's counts are its own
        counters.clear()
        result = train(settings, Path(settings.out))
        out[layout] = (result.losses, result.val_loss, gathered_weights(result.model), result.sample)
        if settings.compile:
            out[f"{layout} counters"] = {key: dict(value) for key, value in counters.items()}
    return out


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    return TrainConfig(model="tiny", data=ONE_FILE_CORPUS, steps=2, global_batch=4, seq_len=32, lr=3e-3, warmup_steps=1,
                       eval_every=2, ckpt_every=0, sample_tokens=0, progress=False, plot=False, device="cpu",
                       out=str(tmp_path_factory.mktemp("cp")))


@pytest.fixture(scope="module")
def results(base_config):
    """{world: [rank results]}: one process of each model first, then the cp launches, then
    the cp=4 checkpoint resumed on one process."""
    _packed_documents(base_config.out)  # before the launches: no rank makes it
    out = {1: run_ranks(1, _train_layouts, base_config, ["dp=1", "tiny-moe dp=1", "tiny-dsv3 dp=1", "docmask dp=1"])}
    for world, layouts in LAYOUTS.items():
        out[world] = run_ranks(world, _train_layouts, base_config, layouts, timeout_s=400)
    out["resume-1"] = run_ranks(1, _train_layouts, base_config, ["resume dp=1"])
    return out


def _norms(cfg: TrainConfig, layout: str) -> list[float]:
    lines = (Path(cfg.out) / _dir(layout) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["grad_norm"] for line in lines]


@pytest.mark.parametrize("world, layout", [(w, p) for w, plans in LAYOUTS.items() for p in plans if "resume" not in p])
def test_layout_matches_single_process(world, layout, results, base_config):
    # The same model and data on one process, eager.
    reference = " ".join([*(word for word in layout.split(" ")[:-1] if word != "compile"), "dp=1"])
    ref_losses, ref_val, ref_weights, ref_sample = results[1][0][reference]
    held: set[str] = set()  # pipeline stages hold their own layers; together, all of them
    for losses, val_loss, weights, sample in (rank[layout] for rank in results[world]):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOLERANCE, (losses, ref_losses)
        assert sample == ref_sample  # "docmask" layouts sample a few tokens at the end
        assert abs(val_loss - ref_val) < TOLERANCE
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)
        held |= weights.keys()
    assert held == ref_weights.keys()
    for norm, ref in zip(_norms(base_config, layout), _norms(base_config, reference), strict=True):
        assert abs(norm - ref) < TOLERANCE * ref


def test_compiled_blocks_hold_the_gather_in_one_graph(results):
    """Under --compile the cp hook and the key/value gather are traced into each block's graph
    (fullgraph=True raises at a break): no break, the four alike blocks share one graph, plus one
    for validation under no_grad, and AOT autograd compiled every one (forward and backward)."""
    for rank in results[2]:
        counts = rank["compile docmask cp=2,recompute=full counters"]
        assert not counts.get("graph_break"), counts
        assert counts["stats"]["unique_graphs"] == 2, counts  # a recompile or a split graph adds one
        assert counts["aot_autograd"]["ok"] == counts["aot_autograd"]["total"] >= 1, counts


@pytest.mark.parametrize("world, layout", [(2, "resume cp=2"), ("resume-1", "resume dp=1")])
def test_cp4_checkpoint_resumes_on_fewer_ranks(world, layout, results):
    """DCP reshards the cp=4 run's step-1 checkpoint onto cp=2 and onto one process: step 2's
    loss and the final weights are the uninterrupted run's (tolerance as above)."""
    ref_losses, ref_val, ref_weights, _ = results[1][0]["dp=1"]
    for losses, val_loss, weights, _ in (rank[layout] for rank in results[world]):
        assert len(losses) == 1 and abs(losses[0] - ref_losses[1]) < TOLERANCE
        assert abs(val_loss - ref_val) < TOLERANCE
        for name, value in weights.items():
            torch.testing.assert_close(value, ref_weights[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)


@pytest.mark.parametrize("seq_len, cp", [(32, 2), (64, 4), (256, 8)])
def test_every_cp_rank_does_the_same_causal_work_within_one_chunk(seq_len, cp):
    """Query-key pairs under the causal mask per cp rank: within one chunk's share of the mean
    (a chunk's share: the mean over the 2 x cp chunks of one chunk's pairs)."""
    from phalanx.layout_rules import causal_pairs

    pairs = [causal_pairs(seq_len, cp, rank) for rank in range(cp)]
    assert sum(pairs) == seq_len * (seq_len + 1) // 2  # every pair once
    mean = sum(pairs) / cp
    chunk_share = mean / 2  # a rank holds two chunks
    assert max(abs(p - mean) for p in pairs) <= chunk_share
    if cp >= 4:  # the bound bites: contiguous quarters of the sequence would break it
        contiguous_first = sum(p + 1 for p in range(seq_len // cp))
        assert mean - contiguous_first > chunk_share


def _painted(blocks, queries: torch.Tensor, seq: int) -> torch.Tensor:
    """How many times each (query, key) pair of the whole sequence is covered by `blocks` of the
    rank whose queries are at absolute positions `queries`: (seq, seq) counts."""
    count = torch.zeros(seq, seq, dtype=torch.int64)
    for b in blocks:
        rows = queries[b.query_start:b.query_end]
        part = torch.ones(len(rows), b.key_end - b.key_start, dtype=torch.int64)
        count[rows[:, None], torch.arange(b.key_start, b.key_end)[None, :]] += part.tril() if b.causal else part
    return count


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_ranks_blocks_cover_the_causal_mask_once(cp):
    """The key blocks of every cp rank (each chunk's causal diagonal, the unmasked keys before
    it), painted at their absolute positions, cover every pair of the causal mask exactly once
    and nothing above the diagonal; with documents (`--doc-mask`, runs of 5 to 11 positions that
    cross chunk borders) every pair of the causal mask within one document once and no other.
    A causal block is square with its queries at the keys' own positions (so `is_causal`'s
    top-left alignment is right): checked too."""
    from phalanx.data.batches import chunk_positions
    from phalanx.parallel.context_parallel_layout import (causal_blocks, document_blocks, document_runs,
                                                          rank_chunks)

    seq = 48
    ids = torch.repeat_interleave(torch.arange(6), torch.tensor([5, 11, 9, 7, 6, 10]))  # (48,)
    causal = torch.ones(seq, seq, dtype=torch.int64).tril()
    same_document = (ids[:, None] == ids[None, :]).long()
    plain, documents = torch.zeros(seq, seq, dtype=torch.int64), torch.zeros(seq, seq, dtype=torch.int64)
    for rank in range(cp):
        queries, chunks = chunk_positions(seq, cp, rank), rank_chunks(cp, rank)
        chunk = seq // cp // len(chunks)
        for blocks, total in ((causal_blocks(chunks, chunk), plain),
                              (document_blocks(chunks, chunk, document_runs(ids)), documents)):
            for b in blocks:
                if b.causal:
                    assert queries[b.query_start:b.query_end].tolist() == list(range(b.key_start, b.key_end))
            total += _painted(blocks, queries, seq)
    assert torch.equal(plain, causal)
    assert torch.equal(documents, causal * same_document)


def test_position_order_undoes_the_rank_order_of_the_gather():
    """Positions of every rank's chunks, concatenated in rank order (what the all-gather
    returns), come back as 0..seq-1."""
    from phalanx.data.batches import chunk_positions
    from phalanx.parallel.context_parallel_layout import position_order

    for cp in (1, 2, 4):
        gathered = torch.cat([chunk_positions(32, cp, r) for r in range(cp)])  # (32,) in rank order
        assert position_order(gathered[None, None, :, None], cp).flatten().tolist() == list(range(32))


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (its flash and memory-efficient kernels)")
KERNELS = [("cpu", torch.float32, 1e-5), ("cpu", torch.bfloat16, 5e-2),
           pytest.param("cuda", torch.bfloat16, 5e-2, marks=_CUDA), pytest.param("cuda", torch.float32, 1e-4, marks=_CUDA)]
"""Where `ChunkAttention`'s kernels run and the tolerance against fp32 attention: fp32 on the
CPU differs in the order of float additions only (the log-sum-exp merge of 2-3 blocks), 1e-5;
bf16 rounds q, k, v and the outputs to 8 bits of mantissa (~4e-3 relative each) over sums of
up to 32 products, 5e-2, where a wrong block or merge moves values by O(1); CUDA's fp32
memory-efficient kernel sums in another order, 1e-4. The CUDA rows run where a GPU is."""


@pytest.mark.parametrize("device, dtype, tolerance", KERNELS)
@pytest.mark.parametrize("kv_heads, value_dim", [(4, 16), (2, 16), (4, 24)])
def test_block_attention_equals_masked_attention_with_gradients(kv_heads, value_dim, device, dtype, tolerance):
    """Each cp rank's `ChunkAttention` on its queries against the whole sequence's keys, put
    back together, equals masked attention of one process (causal, and within documents),
    output and the gradients of q, k and v (k and v summed over ranks, as the gather's
    reduce-scatter sums them): grouped-query attention (2 kv heads for 4) and value heads wider
    than the key's (24 for 16, latent attention's case) included; tolerances in `KERNELS`."""
    import torch.nn.functional as F

    from phalanx.data.batches import chunk_positions
    from phalanx.parallel.context_parallel_attention import ChunkAttention
    from phalanx.parallel.context_parallel_layout import rank_chunks

    gen = torch.Generator().manual_seed(0)
    batch, heads, seq, dim = 2, 4, 32, 16
    q = torch.randn(batch, heads, seq, dim, generator=gen).to(device).requires_grad_()
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen).to(device).requires_grad_()
    v = torch.randn(batch, kv_heads, seq, value_dim, generator=gen).to(device).requires_grad_()
    ids = torch.stack([torch.repeat_interleave(torch.arange(4), torch.tensor([5, 11, 9, 7])),
                       torch.repeat_interleave(torch.arange(2), torch.tensor([20, 12]))])  # (2, 32)
    for documents in (None, ids):
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()
        if documents is not None:
            mask = (mask & (documents[:, :, None] == documents[:, None, :]))[:, None]  # (batch, 1, seq, seq)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(device), enable_gqa=kv_heads != heads)
        weight = torch.randn(ref.shape, generator=gen).to(device)
        ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
        for cp in (1, 2, 4):
            out, grads = torch.zeros_like(ref), [torch.zeros_like(t) for t in (q, k, v)]
            for rank in range(cp):
                mine = chunk_positions(seq, cp, rank)
                local = q.detach()[:, :, mine].to(dtype).requires_grad_()
                keys, values = k.detach().to(dtype).requires_grad_(), v.detach().to(dtype).requires_grad_()
                part = ChunkAttention(rank_chunks(cp, rank), documents).attend(local, keys, values, None)
                out[:, :, mine] = part.detach().float()
                dq, dk, dv = torch.autograd.grad((part * weight[:, :, mine].to(dtype)).sum(), (local, keys, values))
                grads[0][:, :, mine] = dq.float()
                grads[1] += dk.float()
                grads[2] += dv.float()
            torch.testing.assert_close(out, ref, atol=tolerance, rtol=tolerance)
            for got, expected in zip(grads, ref_grads):
                torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def _no_dense_mask_forward(layout: str) -> list[tuple]:
    """On every rank of a cp=2 group: one training forward and backward of `tiny` at seq 48
    (chunks of 12 positions, a rank's 24 queries against 48 keys), recording the shape of
    every tensor an operation makes; the shapes whose last two dims are (queries, keys) of any
    attention call a cp rank could make: (12 or 24) x (a multiple of 12). No other tensor of
    the model has such dims (dim 64, head_dim 16, ffn 128, vocab 256; the rotary table's last
    dims are (8, 2)). Inside `phalanx::cp_attention` (a custom op, opaque to a dispatch mode)
    the recording mode is entered again, so the tensors of its implementation are seen too."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from phalanx.data.batches import chunk_positions
    from phalanx.model.by_name import model_config
    from phalanx.parallel import context_parallel_attention as cp_attention
    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.context_parallel import document_ids
    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import plan_from_string

    seq, chunk = 48, 12
    suspicious = {(q, k) for q in (chunk, 2 * chunk) for k in range(chunk, seq + 1, chunk)}
    impls = {torch.ops.phalanx.cp_attention.default: cp_attention.attend_blocks,
             torch.ops.phalanx.cp_attention_backward.default: cp_attention.attend_blocks_backward}
    found = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in impls:
                with self:
                    result = impls[func](*args, **(kwargs or {}))
            else:
                result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else [result]:
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) in suspicious:
                    found.append((str(func), tuple(t.shape), str(t.dtype)))
            return result

    doc_mask = layout.startswith("docmask")
    cfg = model_config("tiny")
    plan = "cp=2,cp_ring=true" if layout.endswith("ring") else "cp=2"
    mesh = build_mesh(plan_from_string(plan, dist.get_world_size()), torch.device("cpu"))
    model = parallelize(cfg, mesh, seed=0, seq_len=seq, doc_mask=doc_mask)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 19, 13, 11]))[None].repeat(2, 1)  # (2, 48)
    mine = chunk_positions(seq, 2, mesh.cp_rank)
    with Shapes(), document_ids(ids if doc_mask else None):
        model(tokens[:, mine]).float().square().mean().backward()
    return found


@pytest.mark.parametrize("layout", ["causal", "docmask", "causal ring", "docmask ring"])
def test_cp_forward_builds_no_queries_by_keys_tensor(layout):
    """No tensor of (queries x keys) shape, mask or scores, is made in a cp=2 training forward
    and backward of the model, with and without `--doc-mask`, all-gathered or around the ring
    (cp_ring=true) (`_no_dense_mask_forward` says which shapes count): the explicit mask of the
    former implementation, (24, 48), or scores computed outside the flash kernels would be found."""
    for found in run_ranks(2, _no_dense_mask_forward, layout):
        assert found == [], found[:5]


@pytest.mark.parametrize("plan, extra, message", [
    ("cp=2", {"seq_len": 34}, "seq_len=34 must divide by 2 x cp = 4 (cp=2)"),
    ("tp=2,cp=2,sp=true", {"seq_len": 36, "nproc": 4}, "seq_len=36 must divide by 2 x cp x tp = 2 x 2 x 2 = 8"),
    ("cp=3", {"nproc": 2}, "dp=1 x cp=3 x tp=1 x pp=1 = 3, but 2 processes were started"),
    ("dp=2,cp=2,ep=3", {"nproc": 4, "model": "tiny-moe"}, "ep=3 must divide dp x cp = 2 x 2 = 4"),
    ("tp=2,cp=2,ep=3,ep_over_tp=true", {"nproc": 4, "model": "tiny-moe"}, "ep=3 must divide dp x cp x tp = 1 x 2 x 2 = 4"),
    ("cp=2", {"doc_mask": True}, "--doc-mask needs to know where documents start"),
])
def test_bad_cp_plans_fail_before_launch(tmp_path, monkeypatch, plan, extra, message):
    from phalanx.train import launch

    monkeypatch.setattr(launch, "launch_with_restarts", lambda *a, **k: pytest.fail("a worker was started"))
    cfg = TrainConfig(model="tiny", global_batch=8, seq_len=32, device="cpu", out=str(tmp_path / "run"), nproc=2,
                      plan=plan).replace(**extra)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        launch.launch_train(cfg)


def test_generate_refuses_cp(results, base_config, capsys):
    from phalanx.testing.cli_errors import assert_cli_error

    run = Path(base_config.out) / _dir("cp=4")
    assert_cli_error(["generate", "--model", str(run), "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                      "--plan", "cp=2", "--nproc", "2"], capsys, "phalanx generate does not run context parallelism")


@pytest.mark.parametrize("model", ["tiny", "tiny-dsv3"])
def test_doc_mask_equals_running_the_documents_separately(model):
    """One packed sequence of three documents under the document mask gives each document the
    logits it gets alone (rotary attention depends on position differences only, so the packed
    documents' later absolute positions change nothing but float rounding: 1e-5). Without the
    mask the later documents see the earlier ones and differ. tiny-dsv3: latent attention, whose
    mask comes with its latents through the same view."""
    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model
    from phalanx.parallel.context_parallel import apply_context_parallel, document_ids
    from phalanx.parallel.materialize import materialize
    from phalanx.parallel.mesh import ParallelMesh
    from phalanx.plan import Plan

    cfg = model_config(model)
    one = ParallelMesh(plan=Plan(), device=torch.device("cpu"))
    masked = apply_context_parallel(materialize(build_model(cfg), cfg, 0, "cpu"), one, doc_mask=True)
    plain = materialize(build_model(cfg), cfg, 0, "cpu")
    lengths = [5, 11, 16]
    tokens = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]  # (1, 32)
    with torch.no_grad(), document_ids(ids):
        packed = masked(tokens)
    with torch.no_grad():
        alone = torch.cat([plain(piece) for piece in tokens.split(lengths, dim=1)], dim=1)
        unmasked = plain(tokens)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert (unmasked[:, 5:] - alone[:, 5:]).abs().max() > 1e-3


def test_prepare_records_where_documents_start(tmp_path):
    """Document starts per split, also when the split falls back to the tail of the tokens (the
    validation split then starts inside the document that was cut)."""
    from phalanx.data.prepared import open_prepared
    from phalanx.data.prepare import prepare

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc", "defgh", "ij")))
    prepare([str(tmp_path / "docs.jsonl")], tokenizer="bytes", out=str(tmp_path / "all"), val_fraction=0, workers=1,
            progress=False)
    assert open_prepared(tmp_path / "all").train_documents.tolist() == [0, 3, 8]  # bytes: no end-of-text token
    (tmp_path / "one.txt").write_text("x" * 100)
    prepare([str(tmp_path / "one.txt")], tokenizer="bytes", out=str(tmp_path / "tail"), val_fraction=0.1, workers=1,
            progress=False)
    tail = open_prepared(tmp_path / "tail")
    assert tail.manifest["split_by"] == "tail"
    assert tail.train_documents.tolist() == [0] and tail.val_documents.tolist() == [0]


@pytest.mark.parametrize("plan, doc_mask, message", [
    ("cp=2", False, "cp=2 does not support sliding-window attention (model 'tiny' has sliding_window=8)"),
    ("dp=2", True, "--doc-mask does not support sliding-window attention (model 'tiny' has sliding_window=8)"),
])
def test_sliding_window_is_refused_with_cp_and_doc_mask(plan, doc_mask, message):
    """cp attention runs whole or causal key blocks, never a band: a sliding-window model is
    refused before launch, in one line with the reason; without cp and the mask it trains."""
    import dataclasses

    from phalanx.model.by_name import model_config
    from phalanx.plan import plan_from_string
    from phalanx.plan_model_checks import validate_for_model

    windowed = dataclasses.replace(model_config("tiny"), sliding_window=8)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_for_model(plan_from_string(plan, 2), windowed, global_batch=4, seq_len=32, doc_mask=doc_mask)
    validate_for_model(plan_from_string("dp=2", 2), windowed, global_batch=4, seq_len=32)


def _cp_schedule_trace() -> list[tuple[str, int, int]]:
    """On every rank of a cp=2 group: the `cp:` steps of one training forward and backward of
    `tiny` (4 layers) as the profiler recorded them, (name, start, end) in start order."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from phalanx.data.batches import chunk_positions
    from phalanx.model.by_name import model_config
    from phalanx.parallel.apply import parallelize
    from phalanx.parallel.mesh import build_mesh
    from phalanx.plan import plan_from_string

    cfg = model_config("tiny")
    mesh = build_mesh(plan_from_string("cp=2", dist.get_world_size()), torch.device("cpu"))
    model = parallelize(cfg, mesh, seed=0, seq_len=64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        model(tokens[:, chunk_positions(64, 2, mesh.cp_rank)]).float().square().mean().backward()
    steps = [(e.name, e.time_range.start, e.time_range.end) for e in trace.events() if e.name.startswith("cp: ")]
    return sorted(steps, key=lambda step: step[1])


def test_key_value_gather_and_gradient_reduce_scatter_overlap_the_diagonal_blocks():
    """In every layer's attention, forward: the key/value gather is issued, the diagonal blocks
    (which need only this rank's keys) computed, and only then the gather waited for;
    backward: the other blocks' key/value gradients are reduce-scattered while the diagonal
    blocks' gradients compute, and waited for after. A gather waited for at once (or issued
    after the local work) breaks the order. (The keys of layer i+1 are made from layer i's
    output, so within a micro-batch no gather can run ahead of the layer before.)"""
    forward = ["cp: issue the key/value gather", "cp: diagonal blocks", "cp: wait for the key/value gather",
               "cp: blocks before the chunks"]
    backward = ["cp: other block gradients", "cp: issue the gradient reduce-scatter", "cp: diagonal block gradients",
                "cp: wait for the gradient reduce-scatter"]
    for steps in run_ranks(2, _cp_schedule_trace):
        names = [name for name, _, _ in steps]
        assert names == forward * 4 + backward * 4, names
        for i in range(0, len(steps), 4):  # each layer's four steps follow each other, none inside another
            assert all(steps[j][2] <= steps[j + 1][1] for j in range(i, i + 3)), steps[i:i + 4]
