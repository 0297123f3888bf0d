"""The one model-directory reader (phalanx/hf/weights.py): every tensor's dtype, shape and
finiteness checked before use, pytorch_model.bin read with weights_only (never running the
pickle's code), and random initialization only when asked for, said in the start line.

Each test fails if a silent-wrong case of issue 25 comes back: an int8 tensor loading as
zeros, a nan weight loading, a directory without safetensors training from random weights."""

from __future__ import annotations

import shutil

import pytest
import torch

import phalanx.hf as hf
from phalanx.cli import main
from phalanx.errors import UserError
from phalanx.hf.weights import initial_weights
from phalanx.model.by_name import model_config
from tests.hf_models import write_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("reader") / "hf", "llama", num_hidden_layers=2)


@pytest.fixture
def folder(llama, tmp_path):
    return shutil.copytree(llama, tmp_path / "hf")


def _edit(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_an_integer_tensor_is_refused_not_read_as_zeros(folder):
    def to_int8(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = (tensors["model.layers.0.mlp.up_proj.weight"] * 10).to(torch.int8)

    _edit(folder, to_int8)
    with pytest.raises(UserError, match=r"'model.layers.0.mlp.up_proj.weight' is stored as I8; the model needs floating-point"):
        hf.load(folder)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_tensor_is_refused(folder, value):
    def poison(tensors):
        tensors["model.norm.weight"][3] = value

    _edit(folder, poison)
    with pytest.raises(UserError, match=r"tensor 'model.norm.weight' holds non-finite values"):
        hf.load(folder)


def test_pytorch_model_bin_is_read_with_weights_only(folder, tmp_path):
    """A directory with only pytorch_model.bin gives the very weights of its safetensors twin."""
    from safetensors.torch import load_file

    expected = hf.load(folder).state_dict()
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    got = hf.load(folder).state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_sharded_pytorch_model_bin_with_its_index(folder):
    import json

    from safetensors.torch import load_file

    expected = hf.load(folder).state_dict()
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in shards.items():
        torch.save({k: tensors[k] for k in keys}, folder / file)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    (folder / "model.safetensors").unlink()
    got = hf.load(folder).state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_that_runs_code_is_refused_without_running_it(folder, tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"model.norm.weight": _RunsCode(marker)}, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(UserError, match="not a readable PyTorch weights file, or it holds more than tensors"):
        hf.load(folder)
    assert not marker.exists()


def test_random_weights_only_when_asked_for(folder, tmp_path, capsys):
    cfg = model_config(str(folder))
    (folder / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"has no weights \(\*.safetensors or pytorch_model.bin\); pass --init random"):
        initial_weights(str(folder), "auto", cfg)
    (folder / "flax_model.msgpack").write_bytes(b"\0")
    with pytest.raises(UserError, match=r"found flax_model.msgpack, which phalanx does not read"):
        initial_weights(str(folder), "auto", cfg)
    assert initial_weights(str(folder), "random", cfg) is None
    assert initial_weights(str(folder / "config.json"), "auto", cfg) is None  # a bare config.json: its shape
    assert initial_weights("tiny", "auto", model_config("tiny")) is None
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model", "tiny", "--steps", "1", "--global-batch", "2", "--seq-len", "16", "--no-progress", "--no-plot",
              "--sample-tokens", "0", "--eval-every", "0", "--device", "cpu", "--nproc", "1", "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 0
    assert "parameters, random initialization from seed 0) on 1 process" in capsys.readouterr().err
