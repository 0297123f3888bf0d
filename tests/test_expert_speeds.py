"""Each ep rank's speed from a step's figures (phalanx/train/expert_speeds.py), by hand.

A rank's work is its tokens' dense FLOPs plus the expert rows its slots computed, so a rank
that computed more rows in the same time is faster, not slower; an ep rank's pace is the
slowest of the ranks holding its slots. Measured only where the waits are (gloo)."""

from __future__ import annotations

from phalanx.model.by_name import model_config
from phalanx.train.expert_speeds import ep_speeds, flops_per_token, measured_rank_speeds, rank_speeds


def test_work_over_time():
    # 10 tokens x 5 + 100 rows x 1 in 2 s, 10 x 5 + 300 x 1 in 1 s: 75 and 350 FLOP/s.
    assert rank_speeds([2.0, 1.0], [100, 300], tokens=10, dense=5.0, expert_row=1.0) == [75.0, 350.0]
    assert rank_speeds([2.0, 0.0], [100, 300], tokens=10, dense=5.0, expert_row=1.0) is None  # no measurement
    assert ep_speeds([4.0, 1.0, 2.0, 3.0], 2) == [2.0, 1.0]  # ep rank 0 held by ranks 0 and 2, 1 by 1 and 3


def test_measured_speeds_from_a_step_record():
    cfg = model_config("tiny-moe")
    dense, row = flops_per_token(cfg, 32)
    assert row == 18.0 * cfg.dim * cfg.moe_ffn_dim and 0 < dense
    record = {"0": {"rank_tokens": [300, 100]}, "1": {"rank_tokens": [200, 0]}}  # rows: 500 and 100
    speeds = measured_rank_speeds(record, [1.0, 1.0], model_cfg=cfg, seq_len=32, tokens=128, cuda=False)
    assert speeds == [128 * dense + 500 * row, 128 * dense + 100 * row]
    assert measured_rank_speeds(record, [1.0, 1.0], model_cfg=cfg, seq_len=32, tokens=128, cuda=True) is None
    assert measured_rank_speeds({}, [1.0, 1.0], model_cfg=cfg, seq_len=32, tokens=128, cuda=False) is None
