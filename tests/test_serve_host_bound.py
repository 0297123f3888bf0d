"""A Python-driven serving engine's host work per sequence (ServeCosts.host_sequence_s): the
engine overlaps it with the GPU's step, so a step lasts the longer of the two, and a slower
host CPU (Cluster.host_cpu_slowdown, GB200's Grace) stretches it. Hand-computed on presets."""

from __future__ import annotations

import dataclasses

import pytest

from phalanx.errors import UserError
from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import GRACE_HOST_SLOWDOWN, PRESETS as CLUSTERS, cluster_from_dict
from phalanx.planner.serve.costs import GPU_CPP_EXECUTOR, GPU_ENGINE, TORCH_SAMPLER_HOST_S, serve_costs_for
from phalanx.planner.serve.step import ServeLayout, step_time

LAYOUT = ServeLayout(weight_dtype="fp8", kv_dtype="fp8")


def test_host_work_below_the_gpus_step_costs_nothing():
    """Llama 3 70B fp8 on one H200, 64 decodes: the GPU's step (70 GB of weights, ~15 ms) is far
    longer than 64 sequences' host work (0.7 ms): the step is the GPU's, to the bit."""
    model, cluster = MODELS["llama3-70b"], CLUSTERS["dgx-h200"]
    with_host = step_time(model, cluster, LAYOUT, decodes=64, context=1000, costs=GPU_ENGINE)
    without = step_time(model, cluster, LAYOUT, decodes=64, context=1000, costs=GPU_CPP_EXECUTOR)
    assert with_host.breakdown["host"] == 0.0
    assert with_host.seconds == without.seconds


def test_host_work_beyond_the_gpus_step_sets_it():
    """A tiny model at 4,000 decodes: the host's 4,000 x 11.3 us = 45.2 ms is the step (the GPU's
    work is hidden under it), and on a GB200 the Grace CPU's 2.75x of it."""
    model = MODELS["tiny"]
    for name, slowdown in (("dgx-b200", 1.0), ("gb200-nvl72", GRACE_HOST_SLOWDOWN)):
        step = step_time(model, CLUSTERS[name], LAYOUT, decodes=4000, context=100, costs=GPU_ENGINE)
        assert step.seconds == pytest.approx(4000 * TORCH_SAMPLER_HOST_S * slowdown, rel=1e-12), name
        assert step.breakdown["host"] > 0
    assert GRACE_HOST_SLOWDOWN == pytest.approx(2.75, abs=0.01)
    gpu_only = step_time(model, CLUSTERS["dgx-b200"], LAYOUT, decodes=4000, context=100, costs=GPU_CPP_EXECUTOR)
    assert gpu_only.seconds < 4000 * TORCH_SAMPLER_HOST_S


def test_a_prompt_in_the_step_is_one_more_sequence_for_the_host():
    model, cluster = MODELS["tiny"], CLUSTERS["dgx-h100"]
    host_only = dataclasses.replace(GPU_ENGINE, host_sequence_s=1.0)  # a second each: the host dominates
    step = step_time(model, cluster, LAYOUT, decodes=10, context=100, prefill_tokens=500, costs=host_only)
    assert step.seconds == pytest.approx(11.0)


def test_gpu_presets_default_to_the_python_engine_and_the_cpu_has_no_overlap():
    assert serve_costs_for(CLUSTERS["dgx-h100"]).host_sequence_s == TORCH_SAMPLER_HOST_S
    assert GPU_CPP_EXECUTOR.host_sequence_s == 0.0
    assert CLUSTERS["dgx-h100"].host_cpu_slowdown == 1.0


def test_a_host_slowdown_that_is_not_positive_is_one_line():
    with pytest.raises(UserError, match="host_cpu_slowdown=0.0 must be positive"):
        cluster_from_dict({"name": "x", "host_cpu_slowdown": 0.0}, source="x.json")
