"""The unclear or wrongly accepted inputs of issue 25, each with the message a user needs."""

from __future__ import annotations

import argparse
import json

import pytest

from phalanx.errors import UserError
from phalanx.testing.cli_errors import assert_cli_error


def test_simulate_names_the_size_problem_not_zero_considered(tmp_path, capsys):
    line = assert_cli_error(["simulate", "--model", "tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--seq-len", "64",
                             "--plan", "tp=16", "--out", str(tmp_path / "sim")], capsys, "--plan tp=16 gives no layout: ")
    assert "0 considered" not in line and "tp=16" in line
    assert not (tmp_path / "sim").exists()


def test_plan_messages():
    from phalanx.plan import parse_plan, plan_from_string

    with pytest.raises(UserError, match="but 1 process was started"):
        plan_from_string("dp=2", 1)
    with pytest.raises(UserError) as error:
        parse_plan("dq=2", extra_keys=("mbs", "zero"))
    keys = str(error.value).split("valid keys: ")[1].split(", ")
    assert keys.count("zero") == 1 and len(keys) == len(set(keys))


def test_resume_line_names_the_default_plan():
    from phalanx.train.resume_settings import check_resume

    notes = check_resume({"train": {"plan": "dp=2"}}, model={}, where="run", settings={
        "plan": "", "global_batch": 8, "world_size": 2, "expert_slots": 0, "rebalance_every": 0})
    assert notes == ["phalanx: resuming with plan=the default (dp over all processes) (the checkpoint was written with 'dp=2')"]


def test_balance_window_with_a_load_table_is_refused(tmp_path, capsys):
    (tmp_path / "load.json").write_text(json.dumps([[1, 2, 3, 4]]))
    assert_cli_error(["balance", "--load", str(tmp_path / "load.json"), "--replicas", "4", "--gpus", "2", "--window", "3"],
                     capsys, "--window=3 sums the last steps of a run's records", "is a load table")


def test_calibrate_checks_before_measuring(tmp_path, capsys):
    assert_cli_error(["calibrate", "--max-procs", "0", "--out", str(tmp_path / "c.json")], capsys,
                     "--max-procs 0", "must be at least 2")
    (tmp_path / "file").write_text("")
    assert_cli_error(["calibrate", "--quick", "--out", str(tmp_path / "file" / "c.json")], capsys,
                     "--out", "is a file, not a folder")


def test_config_folder_is_called_a_folder(tmp_path, capsys):
    assert_cli_error(["train", "--config", str(tmp_path)], capsys, "is a folder; --config takes a TOML file")


def test_match_on_an_empty_folder(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("x\n")
    (tmp_path / "empty").mkdir()
    assert_cli_error(["match", "--patterns", str(tmp_path / "p.txt"), str(tmp_path / "empty")], capsys,
                     f"input folder {tmp_path / 'empty'} holds no files")


def _generate_args(**changes) -> argparse.Namespace:
    fields = dict(model="", step=None, prompt=None, prompt_ids="1,2,3", tokenizer="bytes", max_new_tokens=2, greedy=True,
                  temperature=None, top_k=None, top_p=None, seed=0, nproc=2, plan="tp=2,sp=true", device="cpu",
                  json=True, rdzv_endpoint="", threads=0)
    return argparse.Namespace(**{**fields, **changes})


def test_generate_pads_sequence_parallel_prompts(tmp_path):
    """tp=2,sp=true with a 3-token prompt: checked at the padded length 4, as decoding pads."""
    import phalanx.hf as hf
    from phalanx.generate.cli import parse_prompt_ids, prepare_job
    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model, init_weights

    cfg = model_config("tiny")
    hf.save(init_weights(build_model(cfg), cfg, seed=0, device="cpu"), tmp_path / "hf")
    job = prepare_job(_generate_args(model=str(tmp_path / "hf")))
    assert job["prompt"] == [1, 2, 3] and job["plan"].startswith("tp=2")
    for bad in ("1,,2", "1,2,", ",1"):
        with pytest.raises(UserError, match="an empty id"):
            parse_prompt_ids(bad)


@pytest.mark.parametrize("value, message", [(float("inf"), "must be a finite number"), (1e-9, "at least 1e-06")])
def test_temperature_bounds(value, message):
    from phalanx.inference.sampling import Sampling

    with pytest.raises(UserError, match=message):
        Sampling(temperature=value).validate()
