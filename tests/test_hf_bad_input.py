"""Bad Hugging Face input is a one-line error naming what is wrong, and nothing is written half."""

from __future__ import annotations

import json

import pytest
import torch

import phalanx.hf as hf
from phalanx.cli import main
from phalanx.errors import UserError
from phalanx.model.hf_config import from_hf_dict, read_model_config
from tests.hf_models import write_checkpoint

pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}


@pytest.mark.parametrize("change, message", [
    ({"model_type": "bert"}, "model_type 'bert' is not supported"),
    ({"model_type": "qwen2_moe"}, "can be planned for but not trained"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "llama3 rope scaling lacks"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"num_attention_heads": None}, "has no 'num_attention_heads'"),
    ({"num_attention_heads": 0}, "n_heads=0 must be at least 1"),
    ({"hidden_size": "big"}, "hidden_size must be a number"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.1},
     "router_jitter_noise=0.1 is not supported"),
])
def test_config_fields_that_change_the_math_are_refused(change, message):
    with pytest.raises(UserError, match=message):
        from_hf_dict({**LLAMA, **change}, source="config.json")


def test_missing_and_malformed_config(tmp_path, capsys):
    with pytest.raises(UserError, match="has no config.json"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(UserError, match="is not valid JSON"):
        read_model_config(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", str(tmp_path), "--nproc", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("phalanx: error:") and "not valid JSON" in err and len(err.splitlines()) == 1


def _edit_weights(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"), "no tensor 'model.layers.1.self_attn.k_proj.weight'"),
    (lambda t: t.update({"model.norm.weight": torch.ones(31)}), r"'model.norm.weight' has shape \[31\], the model needs \[32\]"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(32)}), "would be ignored by the model"),
])
def test_checkpoint_that_does_not_match_its_config(tmp_path, edit, message):
    folder = write_checkpoint(tmp_path / "hf", "llama")
    _edit_weights(folder, edit)
    with pytest.raises(UserError, match=message):
        hf.load(folder)


def test_damaged_safetensors_file(tmp_path):
    folder = write_checkpoint(tmp_path / "hf", "llama")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        hf.load(folder)


def test_export_step_without_checkpoint(tmp_path, capsys):
    with pytest.raises(UserError, match="does not exist"):
        from phalanx.hf.export_run import export_run
        export_run(tmp_path / "nothing", tmp_path / "out")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--step", "4"])
    assert exit_info.value.code == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_non_empty_folder(tmp_path):
    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model, init_weights

    cfg = model_config("tiny")
    model = init_weights(build_model(cfg), cfg, seed=0, device="cpu")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="already exists and is not an empty folder"):
        hf.save(model, tmp_path / "out")
    assert json.dumps(sorted(p.name for p in (tmp_path / "out").iterdir())) == '["keep.txt"]'


def test_export_refuses_a_frozen_routing_bias(tmp_path):
    """router_bias_rate=0 keeps a learned bias (it still steers routing), which Mixtral and
    Qwen3-MoE cannot express: exporting must refuse rather than drop it."""
    import torch

    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model, init_weights

    cfg = model_config("tiny-moe").replace(n_layers=2)
    model = init_weights(build_model(cfg), cfg, seed=0, device="cpu")
    with torch.no_grad():
        model.layers["1"].feed_forward.router.expert_bias[3] = 0.25
    with pytest.raises(UserError, match=r"layers.1.feed_forward.router.expert_bias is not zero"):
        hf.save(model, tmp_path / "out")
