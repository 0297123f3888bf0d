"""Cluster and model files in every supported format, and the errors for bad ones."""

import json

import pytest

from phalanx.errors import UserError
from phalanx.planner.hardware import PRESETS, cluster_from_name, load_cluster_file
from phalanx.planner.model_spec import load_model_file, model_from_name


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_preset_named_in_the_issue_exists():
    for name in ("dgx-a100", "dgx-h100", "dgx-h200", "gb200-nvl72", "pcie-h100", "local"):
        assert cluster_from_name(name).name == name or name == "local"
    assert PRESETS["gb200-nvl72"].fast_domain == 72 and PRESETS["pcie-h100"].fast_domain == 1


def test_cluster_toml_and_json(tmp_path):
    toml = write(tmp_path, "rack.toml", 'name = "rack"\nfast_domain = 16\npeak_tflops = 500\ninter_bw_gbs = 25.0\n')
    c = load_cluster_file(toml)
    assert (c.name, c.fast_domain, c.peak_tflops, c.inter_bw_gbs) == ("rack", 16, 500.0, 25.0)
    js = write(tmp_path, "box.json", json.dumps({"memory_gib": 40, "shared_compute": True}))
    c = cluster_from_name(str(js))
    assert (c.name, c.memory_gib, c.shared_compute) == ("box", 40.0, True)
    # What calibrate measures of the trainer's runtimes (lists of pairs) reads back as written.
    measured = {"ddp_step_overhead_ms": [[2, 3.5], [4, 10.0]], "pp_action_overhead_us": [["1f1b", 120.0]]}
    c = load_cluster_file(write(tmp_path, "cpu.json", json.dumps(measured)))
    assert c.framework.ddp_step_overhead_ms == ((2, 3.5), (4, 10.0)) and c.framework.pp_action_overhead_us == (("1f1b", 120.0),)
    assert c.framework.pp_action_s("gpipe") == pytest.approx(120e-6) and c.framework.pp_action_s("zbv") == 0.0


@pytest.mark.parametrize("text, message", [
    ('nvlink = 8\n', "unknown cluster key 'nvlink'; valid keys: name, devices_per_node"),
    ('fast_domain = "eight"\n', "fast_domain must be an integer"),
    ('peak_tflops = -1\n', "peak_tflops=-1.0 must be positive"),
    ('fast_domain = [\n', "is not valid TOML"),
    ('matmul_efficiency = 1.5\n', "at most 1"),
    ('hbm_efficiency = 1.2\n', "hbm_efficiency=1.2 is a fraction of peak, at most 1"),
    ('sm_count = -4\n', "sm_count=-4 must be 0"),
    ('ddp_step_overhead_ms = [[2]]\n', "ddp_step_overhead_ms must be a list of [processes, ms]"),
    ('pp_action_overhead_us = 5\n', "pp_action_overhead_us must be a list of [schedule, us]"),
    ('fsdp_pp_overhead_groups = [[2, 1.0]]\n', "fsdp_pp_overhead_groups must be a list of [processes, us per step"),
    # Adversarial numbers: each ranked plans by nonsense (a negative latency gave a -140 s step).
    ('measured_groups = [[2, -50000.0, 1.0]]\n', "measured_groups row [2, -50000.0, 1.0] needs"),
    ('measured_groups = [[0, 5.0, 1.0]]\n', "needs a group size of at least 1"),
    ('peak_tflops = 1e400\n', "peak_tflops=inf must be a finite number"),
    ('hbm_tbs = nan\n', "hbm_tbs=nan must be a finite number"),
    ('intra_latency_us = -3\n', "intra_latency_us=-3.0 must not be negative"),
    ('memory_gib = 0\n', "memory_gib=0.0 must be positive"),
    ('min_clock_fraction = 1.5\n', "min_clock_fraction=1.5 must be between 0 \\(clocks not lowered\\) and 1"),
    ('layer_overhead_us = -1\n', "layer_overhead_us=-1.0 must be finite and not negative"),
    ('ddp_step_overhead_ms = [[2, -3.0]]\n', "ddp_step_overhead_ms=[[2, -3.0]] must be finite and not negative"),
    ('pp_action_overhead_us = [["1f1b", inf]]\n', "pp_action_overhead_us=[['1f1b', inf]] must be finite"),
])
def test_bad_cluster_files(tmp_path, text, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[")):
        load_cluster_file(write(tmp_path, "bad.toml", text))


def test_json_infinity_is_refused(tmp_path):
    # JSON has no infinity, but Python's reader turns 1e400 into one.
    with pytest.raises(UserError, match="peak_tflops=inf must be a finite number"):
        load_cluster_file(write(tmp_path, "big.json", '{"peak_tflops": 1e400}'))


def test_gpu_counts_fill_whole_nodes_or_fit_in_one():
    h100 = PRESETS["dgx-h100"]
    for ok in (1, 2, 4, 8, 16, 3072):
        h100.check_device_count(ok)
    with pytest.raises(UserError, match=r"15 GPUs on 'dgx-h100' \(8 per node\): a GPU count must fill whole nodes "
                                        r"or divide one \(e.g. 8 or 16\)"):
        h100.check_device_count(15)
    with pytest.raises(UserError, match=r"7 GPUs .* \(e.g. 4 or 8\)"):
        h100.check_device_count(7)
    PRESETS["local"].check_device_count(7)  # processes on a CPU: any count


def test_unknown_cluster_name_lists_presets():
    with pytest.raises(UserError, match="dgx-h100"):
        cluster_from_name("dgx-z900")


def test_project_model_json(tmp_path):
    path = write(tmp_path, "mine.json", json.dumps({
        "n_layers": 12, "dim": 768, "n_heads": 12, "n_kv_heads": 4, "ffn_dim": 2048, "mlp": "swiglu",
        "vocab_size": 32000, "n_experts": 8, "experts_per_token": 2, "expert_ffn_dim": 512,
        "n_shared_experts": 1, "n_dense_layers": 1}))
    m = load_model_file(path)
    assert (m.name, m.n_layers, m.n_kv_heads, m.n_experts, m.n_dense_layers) == ("mine", 12, 4, 8, 1)


SHAPE = {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 256}


@pytest.mark.parametrize("data, message", [
    ({"layers": 2}, "unknown model key 'layers'; valid keys: name, vocab_size"),
    ({"dim": "big"}, "dim must be a number"),
    ({**SHAPE, "dim": 64, "n_heads": 5, "n_kv_heads": 5}, "not divisible by n_heads"),
    # A file with only some of the shape would plan with a toy model's defaults for the rest.
    ({"n_layers": 80}, "missing model keys dim, n_heads, n_kv_heads, ffn_dim, vocab_size"),
    ({**SHAPE, "n_layers": 0}, "n_layers=0 must be at least 1"),
    ({**SHAPE, "n_heads": 0}, "n_heads=0 must be at least 1"),
    ({**SHAPE, "n_kv_heads": 0}, "n_kv_heads=0 must be at least 1"),
    ({**SHAPE, "vocab_size": 0}, "vocab_size=0 must be at least 1"),
    ({**SHAPE, "ffn_dim": 0}, "ffn_dim=0 must be at least 1"),
    ({"model_type": "bert"}, "model_type 'bert' is not supported"),
    ({"model_type": "llama", "hidden_size": 64, "vocab_size": 100, "num_hidden_layers": 2,
          "intermediate_size": 128}, "has no 'num_attention_heads'"),
])
def test_bad_model_files(tmp_path, data, message):
    with pytest.raises(UserError, match=message):
        load_model_file(write(tmp_path, "m.json", json.dumps(data)))


def test_bad_json_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="is not valid JSON"):
        load_model_file(write(tmp_path, "m.json", "{"))
    with pytest.raises(UserError, match="cannot read model file"):
        load_model_file(tmp_path / "nope.json")
    with pytest.raises(UserError, match="unknown model 'gpt-9'"):
        model_from_name("gpt-9")


HF = {
    "llama": ({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
               "rope_theta": 500000.0}, dict(dim=4096, n_kv_heads=8, ffn_dim=14336, n_experts=0)),
    "mixtral": ({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                 "num_local_experts": 8, "num_experts_per_tok": 2}, dict(n_experts=8, experts_per_token=2,
                                                                         moe_ffn_dim=14336)),
    "qwen2_moe": ({"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24,
                   "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632,
                   "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
                   "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": []},
                  dict(n_experts=60, experts_per_token=4, expert_ffn_dim=1408, n_shared_experts=4)),
    "deepseek_v3": ({"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
                     "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                     "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                     "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3},
                    dict(n_experts=256, n_shared_experts=1, n_dense_layers=3, expert_ffn_dim=2048)),
    "gpt2": ({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
              "n_inner": None, "n_positions": 1024}, dict(dim=768, ffn_dim=3072, mlp="gelu", tie_embeddings=True)),
}


@pytest.mark.parametrize("family", sorted(HF))
def test_hugging_face_configs(tmp_path, family):
    data, expected = HF[family]
    folder = tmp_path / family
    folder.mkdir()
    m = load_model_file(write(folder, "config.json", json.dumps(data)))
    assert m.name == family
    for key, value in expected.items():
        assert getattr(m, key) == value, key


def test_qwen_shared_expert_must_be_whole_experts(tmp_path):
    data = dict(HF["qwen2_moe"][0], shared_expert_intermediate_size=2000)
    with pytest.raises(UserError, match="not a multiple of moe_intermediate_size"):
        load_model_file(write(tmp_path, "config.json", json.dumps(data)))


def test_this_machine_prefers_a_calibration_then_the_gpus_preset(tmp_path, monkeypatch):
    from phalanx.planner.hardware import this_machine

    monkeypatch.setenv("PHALANX_HOME", str(tmp_path))
    assert this_machine("") == "local"
    assert this_machine("NVIDIA H100 80GB HBM3") == "dgx-h100"
    assert this_machine("NVIDIA H100 PCIe") == "pcie-h100"
    assert this_machine("NVIDIA A100-SXM4-80GB") == "dgx-a100"
    assert this_machine("NVIDIA H200") == "dgx-h200"
    assert this_machine("Tesla T4") == "local"
    (tmp_path / "cluster-local.json").write_text("{}")
    assert this_machine("NVIDIA H100 80GB HBM3") == "local"
