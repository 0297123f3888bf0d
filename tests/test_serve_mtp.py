"""Speculative decoding by DeepSeek-V3's multi-token-prediction layer
(`--speculative-config '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'`), on tiny
random DeepSeek-V3 checkpoints with num_nextn_predict_layers=1 (tests/deepseek_models.py).

- The draft's logits against the module's formula computed directly, with `transformers`'
  own decoder layer on the whole sequence (the served draft reads its keys from the paged
  cache, filled step by step, across prompt chunks, decodes and rejected guesses), the
  second of two drafts too (the layer again on its own output).
- Greedy output with the draft equal to the engine's without it and to `transformers`' greedy
  generation (which ignores the MTP layer), under the near-tie rule of tests/serve_server.py:
  a step with a guess feeds two positions in one packed chunk, whose matmuls add in another
  order than a one-row decode's (~1e-6).
- A draft right by construction (`write_deepseek_mtp(bigram=True)`) is kept: acceptance > 0.9.
- Seeded sampling equal to unspeculated sampling of the same seed (every token is the
  request's own draw in order: serve/speculative.py).
- The server with the flag: ids equal `transformers`', acceptance counted in /metrics.
- Preemption (recomputed drafts' keys) and the prefix cache (cached blocks carry the layer's
  keys); the pool sized for the layer it holds.
- Bad input: one line each.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phalanx.hf as hf
from phalanx.cli import main
from phalanx.cpu_ops.onednn_linear import use_onednn
from phalanx.errors import UserError
from phalanx.hf.mtp_weights import load_multi_token_prediction, mtp_layers
from phalanx.scheduling.scheduler import Scheduler, Sequence
from phalanx.scheduling.speculation import SpeculativeConfig
from phalanx.serve.engine import Engine
from phalanx.serve.sampling_params import request_sampling
from tests.deepseek_models import MTP_LAYER, VOCAB, write_deepseek, write_deepseek_mtp
from tests.hf_models import write_checkpoint
from tests.serve_server import assert_greedy_equal

MTP = SpeculativeConfig.parse('{"method": "deepseek_mtp", "num_speculative_tokens": 1}')
MTP2 = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}')
NEW = 24
TOL = dict(rtol=1e-4, atol=1e-4)
"""As tests/test_deepseek_models.py's for phalanx's DeepSeek-V3 against transformers' in fp32
(the absorbed latent attention of a decode and the decompressed one of a prompt chunk add in
other orders than transformers' eager attention; logits are O(1))."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"random": write_deepseek_mtp(root / "random"), "bigram": write_deepseek_mtp(root / "bigram", bigram=True)}


def _load(folder):
    model = hf.load(folder)
    mtp = load_multi_token_prediction(folder, model.cfg, "cpu", torch.float32)
    for module in (model, mtp):
        use_onednn(module)  # as `phalanx serve` loads them on CPU
    return model, mtp


def _prompts() -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(5)
    return {name: torch.randint(0, VOCAB, (n,), generator=generator).tolist() for name, n in (("a", 9), ("b", 21), ("c", 14))}


def _serve(model, mtp, prompts, params, budget: int = 64, config=MTP):
    """Every sequence's output and the scheduler (prompt chunks of at most `budget` tokens;
    `config`: the speculative config when `mtp` drafts)."""
    scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=budget, max_waiting=16,
                          speculative=config if mtp is not None else None)
    engine = Engine(model, scheduler, mtp=mtp)
    seqs = [Sequence.of(name, prompt, NEW, params=params, may_speculate=True) for name, prompt in prompts.items()]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.longest_guess = 0  # the most tokens one step guessed for a sequence
    while scheduler.has_work():
        engine.step()
        scheduler.longest_guess = max([scheduler.longest_guess] + [len(c.guesses) for c in scheduler.last_step.chunks])
    return {seq.seq_id: seq.output for seq in seqs}, scheduler


class ReferenceMtp:
    """The MTP layer's logits computed directly: transformers' model for the final-normed
    hidden states h_i and the embedding, enorm/hnorm/eh_proj written out, transformers'
    DeepseekV3DecoderLayer (with the checkpoint's layer-3 tensors) over the whole sequence with
    a causal mask, then shared_head written out."""

    def __init__(self, folder):
        import transformers
        from safetensors.torch import load_file
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.tensors, self.prefix = load_file(folder / "model.safetensors"), f"model.layers.{MTP_LAYER}."
        self.layer = DeepseekV3DecoderLayer(self.model.config, MTP_LAYER).eval()
        prefix, tensors = self.prefix, self.tensors
        experts = range(self.model.config.n_routed_experts)
        fused = {  # transformers stacks the experts: per expert in the checkpoint
            "mlp.experts.gate_up_proj": torch.stack([torch.cat([tensors[f"{prefix}mlp.experts.{e}.{w}_proj.weight"]
                                                                for w in ("gate", "up")]) for e in experts]),
            "mlp.experts.down_proj": torch.stack([tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] for e in experts])}
        self.layer.load_state_dict({name: fused[name] if name in fused else tensors[prefix + name]
                                    for name in self.layer.state_dict()})

    def _rms(self, x, name):
        weight = self.tensors[self.prefix + name]
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.model.config.rms_norm_eps)

    def _input(self, h, e):
        """eh_proj([enorm(e); hnorm(h)])."""
        return F.linear(torch.cat([self._rms(e, "enorm.weight"), self._rms(h, "hnorm.weight")], dim=-1),
                        self.tensors[self.prefix + "eh_proj.weight"])

    def _layer(self, x):
        positions = torch.arange(x.shape[1])[None]
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        return self.layer(x, attention_mask=mask, position_ids=positions,
                          position_embeddings=self.model.model.rotary_emb(x, positions))

    def _logits(self, out):
        return F.linear(self._rms(out, "shared_head.norm.weight"), self.tensors[self.prefix + "shared_head.head.weight"])

    @torch.no_grad()
    def drafts(self, ids: list[int], depth: int = 1) -> list[torch.Tensor]:
        """The logits of the `depth` drafts after `ids`: the layer at the position before the
        last token (h there, the last token's embedding), then again at the next position on
        its own output there and the embedding of its greedy draft."""
        tokens = torch.tensor([ids])
        h = self.model.model(tokens).last_hidden_state[:, :-1]  # (1, T - 1, dim), after the final norm
        x = self._input(h, self.model.model.embed_tokens(tokens[:, 1:]))  # at i: Emb(t_{i+1})
        found = []
        for _ in range(depth):
            out = self._layer(x)[:, -1:]  # (1, 1, dim)
            found.append(self._logits(out)[0, 0])
            x = torch.cat([x, self._input(out, self.model.model.embed_tokens(found[-1].argmax()[None, None]))], dim=1)
        return found


@pytest.mark.parametrize("config", [MTP, MTP2], ids=["1", "2"])
def test_the_draft_is_the_formula_computed_directly(folders, config):
    """Greedy, prompt chunks of 8 tokens, one or two tokens drafted a step: every draft the
    engine made (the MTP logits at the last position a step made final, its keys of the
    earlier positions read from the paged cache; the second on the layer's own output one
    position on) equals the reference's after the tokens the sequence had then."""
    model, mtp = _load(folders["random"])
    seen: list[tuple[int, torch.Tensor]] = []
    prompt = _prompts()["b"]
    scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_waiting=4,
                          speculative=config)
    engine = Engine(model, scheduler, mtp=mtp)
    seq = Sequence.of("b", prompt, NEW, params=request_sampling(0, 1, None, 0), may_speculate=True)
    logits = mtp.logits

    def spy(rows: torch.Tensor) -> torch.Tensor:
        out = logits(rows)
        seen.append((len(seq.tokens), len(seq.drafted), out[0].clone()))  # tokens then, which draft
        return out

    mtp.logits = spy
    scheduler.add(seq)
    while scheduler.has_work():
        engine.step()
    reference = ReferenceMtp(folders["random"])
    assert len(seen) >= NEW // 2 and seen[0][:2] == (len(prompt) + 1, 0)
    assert {depth for _, depth, _ in seen} == set(range(config.num_speculative_tokens))
    for length, depth, row in seen:
        torch.testing.assert_close(row, reference.drafts(seq.tokens[:length], depth + 1)[depth], **TOL)
    assert scheduler.guessed_tokens > 0


@pytest.mark.parametrize("kind,config", [("random", MTP), ("bigram", MTP), ("random", MTP2), ("bigram", MTP2)],
                         ids=["random-1", "bigram-1", "random-2", "bigram-2"])
def test_greedy_with_the_draft_equals_greedy_without_and_transformers(folders, kind, config):
    """Three prompts batched, 24 tokens each, greedy, one or two tokens drafted a step: the same
    ids as without the draft and as `transformers` (near-tie rule); a draft right by
    construction is kept (> 0.9 of them: only a near-tie of the model's top two logits could
    differ; the bigram layer ignores the hidden state, so its second draft, from its own
    output, is right too)."""
    from tests.serve_server import transformers_greedy

    model, mtp = _load(folders[kind])
    params = request_sampling(0, 1, None, 0)
    plain, _ = _serve(model, None, _prompts(), params, budget=16)
    drafted, scheduler = _serve(model, mtp, _prompts(), params, budget=16, config=config)
    references = transformers_greedy(folders[kind], list(_prompts().values()), NEW)
    for name, (reference, logits) in zip(_prompts(), references):
        assert_greedy_equal(drafted[name], plain[name], logits)
        assert_greedy_equal(drafted[name], reference, logits)
    assert scheduler.guessed_tokens > 0 and scheduler.longest_guess == config.num_speculative_tokens
    if kind == "bigram":
        assert scheduler.kept_guesses > 0.9 * scheduler.guessed_tokens, (scheduler.kept_guesses, scheduler.guessed_tokens)


@pytest.mark.parametrize("config", [MTP, MTP2], ids=["1", "2"])
def test_a_seeded_draw_is_the_same_with_the_draft(folders, config):
    """Temperature 0.7, seed 3, one or two tokens drafted a step: the output with drafts equals
    the output without, and drafts were kept (the bigram draft is the model's likeliest token)."""
    model, mtp = _load(folders["bigram"])
    params = request_sampling(0.7, 1, None, 3)
    plain, _ = _serve(model, None, _prompts(), params)
    drafted, scheduler = _serve(model, mtp, _prompts(), params, config=config)
    assert drafted == plain
    assert scheduler.kept_guesses > 0


def test_server_with_the_draft_equals_transformers_and_counts_acceptance(folders):
    """`phalanx serve --speculative-config deepseek_mtp` through the real `openai` client:
    greedy ids equal `transformers`' (near-tie rule), and /metrics counts the guesses and the
    kept ones (the bigram draft: most of them)."""
    pytest.importorskip("openai")
    from tests.serve_server import ServeProcess, transformers_greedy

    folder = folders["bigram"]
    prompts = list(_prompts().values())
    server = ServeProcess(folder, "--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}')
    try:
        client = server.client()
        for prompt, (reference, logits) in zip(prompts, transformers_greedy(folder, prompts, NEW)):
            answer = client.completions.create(model=server.name, prompt=prompt, max_tokens=NEW, temperature=0,
                                               extra_body={"return_token_ids": True}).choices[0]
            assert_greedy_equal(answer.token_ids, reference, logits)
        samples = server.metrics()
        guessed, kept = samples["phalanx_spec_decode_draft_tokens_total"], samples["phalanx_spec_decode_accepted_tokens_total"]
        assert guessed > 0 and kept > 0.9 * guessed
        assert samples["phalanx_spec_decode_acceptance_rate"] == kept / guessed
    finally:
        server.stop()


@pytest.mark.parametrize("text,message", [
    ('{"method": "deepseek_mtp", "num_speculative_tokens": 0}', ">= 1"),
    ('{"method": "deepseek_mtp"}', "needs num_speculative_tokens"),
    ('{"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3}', "unknown field"),
    ('{"method": ["deepseek_mtp"], "num_speculative_tokens": 1}', "is not supported"),
])
def test_bad_mtp_config_is_one_line(text, message):
    with pytest.raises(UserError, match=message):
        SpeculativeConfig.parse(text)


def test_the_method_on_a_checkpoint_without_mtp_layers_is_one_line(tmp_path, capsys):
    """A DeepSeek-V3 checkpoint with num_nextn_predict_layers 0, a Llama checkpoint, and one
    whose config promises the layer (transformers' default, 1) but holds none of its tensors:
    one line each, from the server's start-up check (before any weight is read) or the loader."""
    none = write_deepseek(tmp_path / "none", num_nextn_predict_layers=0)
    llama = write_checkpoint(tmp_path / "llama", "llama")
    promised = write_deepseek(tmp_path / "promised", num_nextn_predict_layers=1)
    with pytest.raises(UserError, match=r"has no multi-token-prediction layer \(num_nextn_predict_layers 0\)"):
        mtp_layers(none)
    with pytest.raises(UserError, match="is for DeepSeek-V3-family checkpoints; .* is llama"):
        mtp_layers(llama)
    with pytest.raises(UserError, match=r"has no tensor 'model\.layers\.3\.enorm\.weight'"):
        load_multi_token_prediction(promised, hf.load(promised).cfg, "cpu", torch.float32)
    for folder, shown in ((none, "has no multi-token-prediction layer"), (llama, "DeepSeek-V3-family")):
        capsys.readouterr()  # what writing and loading the checkpoints said
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--model", str(folder), "--port", "0", "--speculative-config",
                  '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("phalanx: error: ") and shown in err[0], err


def test_the_pool_is_sized_for_the_draft_layer_it_holds(folders):
    """The MTP layer's keys live in the model's block pool as one more layer: after a run the
    pool holds n_layers + 1 layers of `bytes_per_block`, and `--kv-cache-memory` divides by
    that (serve/loading.py): a budget of 1 MiB holds 1 MiB // that many blocks."""
    from types import SimpleNamespace

    from phalanx.serve.loading import _kv_blocks
    from phalanx.serve.paged_cache import bytes_per_block, kv_channels_per_position

    model, mtp = _load(folders["random"])
    scheduler = Scheduler(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, max_waiting=4,
                          speculative=MTP)
    engine = Engine(model, scheduler, mtp=mtp)
    scheduler.add(Sequence.of("a", _prompts()["a"], 4, may_speculate=True))
    while scheduler.has_work():
        engine.step()
    cfg, pools = model.cfg, engine.runner.cache.pools
    assert sorted(pools) == list(range(cfg.n_layers + 1))
    per_block = bytes_per_block(4, cfg.n_layers + 1, kv_channels_per_position(cfg), 4)
    assert sum(t.numel() * t.element_size() for t in pools.values()) == 16 * per_block
    job = SimpleNamespace(block_size=4, num_kv_blocks=None, kv_cache_memory=1 / 1024, max_num_seqs=2, speculative=None)
    plain = _kv_blocks(job, cfg, 1, torch.device("cpu"), torch.float32)
    job.speculative = MTP
    drafting = _kv_blocks(job, cfg, 1, torch.device("cpu"), torch.float32)
    assert (plain, drafting) == ((1 << 20) // bytes_per_block(4, cfg.n_layers, kv_channels_per_position(cfg), 4),
                                 (1 << 20) // per_block)


def test_preempted_sequences_with_drafts_equal_transformers(folders):
    """A pool of 14 blocks of 4 positions for three sequences that need up to 45 positions each,
    two tokens drafted a step: sequences are preempted and recomputed (their MTP keys with
    them; a draft's blocks are taken only when free), and the greedy ids still equal
    `transformers`' (near-tie rule)."""
    from tests.serve_server import transformers_greedy

    model, mtp = _load(folders["random"])
    scheduler = Scheduler(num_blocks=14, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_waiting=4,
                          speculative=MTP2)
    engine = Engine(model, scheduler, mtp=mtp)
    seqs = [Sequence.of(name, prompt, NEW, params=request_sampling(0, 1, None, 0), may_speculate=True)
            for name, prompt in _prompts().items()]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work():
        engine.step()
    assert scheduler.preemptions > 0 and scheduler.guessed_tokens > 0
    for seq, (reference, logits) in zip(seqs, transformers_greedy(folders["random"], list(_prompts().values()), NEW)):
        assert_greedy_equal(seq.output, reference, logits)


def test_a_prefix_found_in_the_cache_holds_the_draft_layers_keys(folders):
    """A second request with the first one's prompt finds its full blocks in the prefix cache
    and computes only the rest: its drafts still equal the formula's, since the MTP layer's keys
    of those positions are in the same blocks (one pool, one block table). (Zeroing the layer's
    pool before the second request makes this fail.)"""
    model, mtp = _load(folders["random"])
    scheduler = Scheduler(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_waiting=4,
                          speculative=MTP)
    engine = Engine(model, scheduler, mtp=mtp)
    prompt, logits = _prompts()["b"], mtp.logits
    seen: list[tuple[int, torch.Tensor]] = []  # the second request's drafts: its tokens then, the logits

    def spy(rows: torch.Tensor) -> torch.Tensor:
        out = logits(rows)
        if seq.seq_id == "second":
            seen.append((len(seq.tokens), out[0].clone()))
        return out

    mtp.logits = spy
    for name in ("first", "second"):
        seq = Sequence.of(name, prompt, 6, params=request_sampling(0, 1, None, 0), may_speculate=True)
        scheduler.add(seq)
        while scheduler.has_work():
            engine.step()
    assert seq.cached_tokens == 20  # five blocks of the 21-token prompt found
    reference = ReferenceMtp(folders["random"])
    assert seen
    for length, row in seen:
        torch.testing.assert_close(row, reference.drafts(seq.tokens[:length])[0], **TOL)
