"""`phalanx balance`: its inputs (JSON, .npy, a training run's records), its output, its one-line
errors, and that it never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from phalanx.cli import main
from phalanx.testing.cli_errors import assert_cli_error

EPLB_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
               [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
EPLB_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
FLAGS = ["--replicas", "16", "--groups", "4", "--nodes", "2", "--gpus", "8"]
KEYS = {"phy2log", "log2phy", "logcnt", "balancedness", "imbalance", "before", "policy", "seconds"}


def _run(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr()
    assert exit_info.value.code == 0, out.err
    return out.out


def _json(argv, capsys):
    return json.loads(_run([*argv, "--json"], capsys))


def _fails(argv, capsys, message):
    assert_cli_error(argv, capsys, message)


@pytest.fixture
def golden(tmp_path):
    path = tmp_path / "load.json"
    path.write_text(json.dumps(EPLB_WEIGHT))
    return str(path)


def test_json_output_reference_example(golden, capsys):
    record = _json(["balance", "--load", golden, *FLAGS, "--no-refine"], capsys)
    assert set(record) == KEYS
    assert record["phy2log"] == EPLB_PHY2LOG and record["policy"] == "hierarchical"
    assert np.array(record["log2phy"]).shape == (2, 12, 2)
    assert set(record["balancedness"]) == {"per_layer", "overall"} and set(record["imbalance"]) == {"per_layer", "overall"}
    assert set(record["before"]) == {"balancedness", "imbalance"}
    # GPU loads by hand from the published placement: layer 0, GPU g holds slots 2g, 2g+1.
    count = np.bincount(EPLB_PHY2LOG[0], minlength=12)
    gpu = [sum(EPLB_WEIGHT[0][e] / count[e] for e in EPLB_PHY2LOG[0][2 * g : 2 * g + 2]) for g in range(8)]
    assert record["balancedness"]["per_layer"][0] == pytest.approx(np.mean(gpu) / max(gpu), rel=1e-12)
    assert record["imbalance"]["per_layer"][0] == pytest.approx((max(gpu) - np.mean(gpu)) / np.mean(gpu), rel=1e-12)


def test_policy_auto_and_forced(golden, capsys):
    assert _json(["balance", "--load", golden, "--replicas", "18", "--groups", "4", "--nodes", "3", "--gpus", "6"], capsys)["policy"] == "global"
    assert _json(["balance", "--load", golden, *FLAGS, "--policy", "global"], capsys)["policy"] == "global"


def test_previous_reports_moved_slots(golden, tmp_path, capsys):
    first = _run(["balance", "--load", golden, *FLAGS, "--json"], capsys)
    (tmp_path / "plan.json").write_text(first)
    record = _json(["balance", "--load", golden, *FLAGS, "--previous", str(tmp_path / "plan.json")], capsys)
    assert record["moved_slots"] == 0 and set(record) == KEYS | {"moved_slots"}


def test_table_and_plot(golden, tmp_path, capsys):
    out = _run(["balance", "--load", golden, *FLAGS, "--plot", str(tmp_path / "gpus.png")], capsys)
    assert "policy hierarchical" in out and "overall balancedness" in out
    assert (tmp_path / "gpus.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_npy_and_training_run_loads(tmp_path, capsys):
    np.save(tmp_path / "load.npy", np.array(EPLB_WEIGHT, dtype=np.float32))
    assert _json(["balance", "--load", str(tmp_path / "load.npy"), *FLAGS, "--no-refine"], capsys)["phy2log"] == EPLB_PHY2LOG
    # A run's records, as `phalanx train` writes them (docs/moe.md): 3 steps, layers "1" and "3".
    run = tmp_path / "run"
    run.mkdir()
    steps = [{"1": EPLB_WEIGHT[0], "3": EPLB_WEIGHT[1]}, {"1": [1] * 12, "3": [2] * 12}, {"1": EPLB_WEIGHT[0], "3": EPLB_WEIGHT[1]}]
    lines = [json.dumps({"step": 0, "loss": 3.0})]  # a record without `moe` is skipped
    lines += [json.dumps({"step": i + 1, "moe": {k: {"expert_tokens": v, "dropped": 0} for k, v in s.items()}}) for i, s in enumerate(steps)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    # The last step alone is the published example; all three are twice it plus the flat step.
    assert _json(["balance", "--load", str(run), *FLAGS, "--no-refine", "--window", "1"], capsys)["phy2log"] == EPLB_PHY2LOG
    from phalanx.balance.loads import read_load

    total = read_load(run / "metrics.jsonl")
    assert total.tolist() == (2 * np.array(EPLB_WEIGHT) + [[1] * 12, [2] * 12]).tolist()


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "15", "--gpus", "8"], "do not split evenly over --gpus=8"),
    (["--replicas", "8", "--gpus", "8"], "fewer slots than the 12 experts"),
    (["--replicas", "16", "--groups", "5", "--gpus", "8"], "--groups=5 does not divide the 12 experts"),
    (["--replicas", "18", "--nodes", "4", "--gpus", "6"], "--gpus=6 is not divisible by --nodes=4"),
    (["--replicas", "32", "--groups", "4", "--nodes", "2", "--gpus", "2"], "16 slots per node is more than its 6 experts x 1 GPUs"),
    (["--replicas", "16", "--gpus", "8", "--policy", "best"], "is not one of auto, hierarchical, global"),
    (["--replicas", "16", "--groups", "3", "--nodes", "2", "--gpus", "8", "--policy", "hierarchical"], "needs --groups=3 divisible by --nodes=2"),
    (["--replicas", "16", "--gpus", "0"], "--gpus=0 must be at least 1"),
])
def test_bad_flags(golden, capsys, flags, message):
    _fails(["balance", "--load", golden, *flags], capsys, message)


@pytest.mark.parametrize("content, message", [
    ([[1, 2, -3, 4]], "negative values (layer 0, expert 2: -3)"),
    ([[1, 2, float("nan"), 4]], "non-finite"),
    ([[1, 2], [3]], "rectangular"),
    ([1, 2, 3, 4], "got 1 dimension"),
])
def test_bad_loads(tmp_path, capsys, content, message):
    (tmp_path / "load.json").write_text(json.dumps(content))
    _fails(["balance", "--load", str(tmp_path / "load.json"), "--replicas", "4", "--gpus", "2"], capsys, message)


def test_bad_files(tmp_path, golden, capsys):
    _fails(["balance", "--load", str(tmp_path / "none.json"), *FLAGS], capsys, "does not exist")
    (tmp_path / "bad.json").write_text("[[1, 2")
    _fails(["balance", "--load", str(tmp_path / "bad.json"), *FLAGS], capsys, "is not JSON")
    (tmp_path / "m.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    _fails(["balance", "--load", str(tmp_path / "m.jsonl"), *FLAGS], capsys, "has no expert load records")
    _fails(["balance", "--load", str(tmp_path / "m.jsonl"), *FLAGS, "--window", "0"], capsys, "--window=0 must be at least 1")
    _fails(["balance", "--load", str(tmp_path), *FLAGS], capsys, "has no metrics.jsonl")
    # The load's shape against the flags, and a previous plan of another shape.
    (tmp_path / "wide.json").write_text(json.dumps([[1.0] * 10]))
    _fails(["balance", "--load", str(tmp_path / "wide.json"), *FLAGS], capsys, "--groups=4 does not divide the 10 experts (the load has 1 layers x 10 experts)")
    (tmp_path / "prev.json").write_text(json.dumps({"phy2log": [[0] * 16]}))
    _fails(["balance", "--load", golden, *FLAGS, "--previous", str(tmp_path / "prev.json")], capsys, "is 1 x 16, but this plan is 2 layers x 16 slots")
    (tmp_path / "prev.json").write_text(json.dumps({"phy2log": [[0] * 16, list(range(12)) + [0] * 4]}))
    _fails(["balance", "--load", golden, *FLAGS, "--previous", str(tmp_path / "prev.json")], capsys, "no replica of expert 1 in layer 0")
    (tmp_path / "prev.json").write_text(json.dumps({"placement": []}))
    _fails(["balance", "--load", golden, *FLAGS, "--previous", str(tmp_path / "prev.json")], capsys, "no phy2log")


def test_balance_imports_no_torch(golden, tmp_path):
    code = (
        "import sys\n"
        "from phalanx.cli import main\n"
        f"try:\n    main(['balance', '--load', {golden!r}, '--replicas', '16', '--gpus', '8', '--json', '--plot', {str(tmp_path / 'p.png')!r}])\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["policy"] == "hierarchical"  # one node, one group
