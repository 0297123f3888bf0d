"""The pipeline split is a pure function of the model's shape: balanced by cost or by hand."""

from __future__ import annotations

import pytest

from phalanx.errors import UserError
from phalanx.model.config import PRESETS, ModelConfig
from phalanx.parallel.stage_split import balanced_layer_counts, split_stages, stage_modules, unit_costs


def test_equal_costs_split_evenly():
    assert balanced_layer_counts([0.0] + [1.0] * 8 + [0.0], 4) == [2, 2, 2, 2]


def test_expensive_output_layer_shortens_the_last_stage():
    # The output costs three layers: an equal split [2, 2, 2, 2] costs 2, 2, 2, 5; the best
    # split leaves the last stage one layer (cost 4). Of the equally good splits, the one with
    # the earliest cuts is returned (earlier stages lighter), so the result is deterministic.
    counts = balanced_layer_counts([0.0] + [1.0] * 8 + [3.0], 4)
    assert counts == [2, 2, 3, 1]


def test_embedding_is_not_free():
    # An embedding as costly as a layer pushes one layer off the first stage.
    assert balanced_layer_counts([1.0] + [1.0] * 5 + [0.0], 2) == [2, 3]


def test_minimizes_the_most_expensive_stage():
    """The split is exact: no other contiguous split has a cheaper slowest stage."""
    import itertools

    costs = [0.5, 3.0, 1.0, 1.0, 2.0, 1.0, 4.0, 1.0, 0.7]
    layers = costs[1:-1]
    counts = balanced_layer_counts(costs, 3)

    def worst(split):
        bounds, first, out = list(itertools.accumulate(split)), 0, []
        for i, end in enumerate(bounds):
            out.append(sum(layers[first:end]) + (costs[0] if i == 0 else 0) + (costs[-1] if i == len(split) - 1 else 0))
            first = end
        return max(out)

    every = [c for c in itertools.product(range(1, 6), repeat=3) if sum(c) == len(layers)]
    assert worst(counts) == min(worst(c) for c in every)


def test_llama_output_layer_weighs_like_several_layers():
    """With a 128k vocabulary, the unembedding costs about two Llama-3-8B layers; the balanced
    split gives the last of 8 stages fewer layers than an equal split would."""
    cfg = PRESETS["llama3-8b"]
    costs = unit_costs(cfg, seq_len=8192, tokens_per_microbatch=8192)
    assert 1.5 < costs[-1] / costs[1] < 3
    assert costs[0] > 0
    counts = balanced_layer_counts(costs, 8)
    assert sum(counts) == 32 and counts[-1] < 4 and counts != [4] * 8


def test_module_names_per_stage():
    assert stage_modules([1, 2, 1]) == [
        ["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "norm", "output"],
    ]


def test_hand_given_split_is_used_as_is():
    cfg = ModelConfig(n_layers=4)
    assert split_stages(cfg, 2, split="3:1", seq_len=32, tokens_per_microbatch=64) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["layers.3", "norm", "output"],
    ]


@pytest.mark.parametrize("split, message", [
    ("2:1", "adds up to 3 layers, but the model has 4"),
    ("2:1:1", "gives 3 stages, but pp x virtual = 2"),
    ("4:0", "every stage needs at least one layer"),
    ("a:b", "layer counts separated by ':'"),
])
def test_bad_hand_split(split, message):
    with pytest.raises(UserError, match=message):
        split_stages(ModelConfig(n_layers=4), 2, split=split, seq_len=32, tokens_per_microbatch=64)


def test_more_stages_than_layers():
    with pytest.raises(UserError, match="8 pipeline stages need at least 8 layers; the model has 4"):
        balanced_layer_counts([0.0] + [1.0] * 4 + [0.0], 8)
