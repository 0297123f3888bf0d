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
        "tiny-dsv3 dp=2,cp=2,ep=4", "tiny-moe tp=2,cp=2,ep=4,ep_over_tp=true"],
    2: ["cp=2", "resume cp=2", "compile docmask cp=2,recompute=full"],
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
and AOT autograd's graphs without inductor's C++), whose blocks then hold the gather.
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


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunk_masks_put_together_are_the_whole_sequence_mask(cp):
    """Each cp rank's mask (its queries against the gathered keys, in rank order), its rows and
    columns put back at their absolute positions, is the mask kv_cache.py builds for the whole
    sequence: causal, and with a sliding window (which cp therefore supports)."""
    from phalanx.data.batches import chunk_positions
    from phalanx.model.kv_cache import attention_mask
    from phalanx.parallel.context_parallel import ContextParallel

    seq = 32
    keys = torch.cat([chunk_positions(seq, cp, r) for r in range(cp)])
    for window in (0, 5):
        whole = torch.zeros(seq, seq, dtype=torch.bool)
        for rank in range(cp):
            mask = ContextParallel(cp, rank, None, doc_mask=False).view(seq // cp, "cpu").mask(window)
            whole[chunk_positions(seq, cp, rank)[:, None], keys[None, :]] = mask
        expected = attention_mask(seq, seq, window, "cpu")
        assert torch.equal(whole, expected if expected is not None else torch.ones(seq, seq).tril().bool())


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
