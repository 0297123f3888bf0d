"""The --plan grammar: round trips, and every invalid plan names its numbers."""

import pytest

from phalanx.errors import UserError
from phalanx.plan import Plan, parse_plan, plan_from_string


def test_round_trip():
    text = "dp=2,tp=2,pp=2,fsdp=true,schedule=interleaved,virtual=2,microbatches=8"
    plan = plan_from_string(text, 8)
    assert plan == Plan(dp=2, tp=2, pp=2, fsdp=True, schedule="interleaved", virtual=2, microbatches=8)
    assert plan_from_string(plan.to_string(), 8) == plan


def test_zero_levels_and_the_older_fsdp_key():
    """fsdp=true is zero=3 and prints as zero=3; Plan(fsdp=True) (the planner's spelling) too."""
    assert plan_from_string("dp=2,fsdp=true", 2) == Plan(dp=2, zero=3) == Plan(dp=2, fsdp=True)
    assert str(Plan(dp=2, fsdp=True)) == "dp=2,zero=3" and Plan(dp=2, zero=3).fsdp
    assert plan_from_string("dp=2,fsdp=false", 2).zero == 0
    assert not Plan(dp=2, zero=2).fsdp and Plan(dp=2, zero=2).shards_dp
    assert Plan(dp=2, zero=3).replace(zero=0).zero == 0  # replace must not read fsdp back
    text = "dp=4,zero=3,offload=true,param_dtype=bf16,reduce_dtype=fp32,replicate=2"
    assert plan_from_string(plan_from_string(text, 4).to_string(), 4) == plan_from_string(text, 4)


@pytest.mark.parametrize("text", ["dp=1,param_dtype=bf16", "dp=2,zero=3,param_dtype=bf16"])
def test_bf16_weights_under_fp32_refused_in_every_layout(text):
    """bf16 compute weights are mixed precision in every layout: asked for under --dtype fp32,
    the run would compute in bf16 while it says fp32, so --dtype bf16 is named instead."""
    from phalanx.model.by_name import model_config
    from phalanx.plan_model_checks import validate_for_model

    with pytest.raises(UserError) as error:
        validate_for_model(plan_from_string(text, None), model_config("tiny"), global_batch=8, seq_len=32, dtype="fp32")
    assert "param_dtype=bf16 with --dtype fp32 would compute in bf16; use --dtype bf16" in str(error.value)


@pytest.mark.parametrize(
    "text, dtype, param, reduce",
    [("dp=2", "bf16", "bf16", "fp32"), ("dp=2", "fp32", "fp32", "fp32"), ("dp=2,param_dtype=fp32", "bf16", "fp32", "fp32"),
     ("dp=2,tp=2,reduce_dtype=bf16", "bf16", "bf16", "bf16"), ("dp=2,zero=2,param_dtype=fp32", "bf16", "fp32", "fp32"),
     ("param_dtype=fp32", "bf16", "fp32", "fp32")],
)
def test_precision_defaults_follow_dtype(text, dtype, param, reduce):
    from phalanx.model.by_name import model_config
    from phalanx.plan_model_checks import validate_for_model

    plan = validate_for_model(plan_from_string(text, None), model_config("tiny"), global_batch=8, seq_len=32, dtype=dtype)
    assert (plan.param_dtype, plan.reduce_dtype) == (param, reduce)


def test_extra_keys_for_the_planner():
    plan, extras = parse_plan("tp=8,mbs=2", extra_keys=("mbs",))
    assert plan.tp == 8 and extras == {"mbs": "2"}


@pytest.mark.parametrize(
    "text, world, message",
    [
        ("dp=3,tp=2,pp=2", 8, "dp=3 x tp=2 x pp=2 = 12, but 8 processes were started"),
        ("dp=2,colour=blue", 2, "unknown plan key 'colour'; valid keys: dp, tp, pp"),
        ("dp=two", 2, "dp='two' must be an integer"),
        ("dp=2,fsdp=maybe", 2, "fsdp='maybe' must be true or false"),
        ("dp=2,dp=2", 2, "given twice"),
        ("dp", 1, "not of the form key=value"),
        ("dp=0", 0, "dp=0 must be at least 1"),
        ("dp=4,ep=3", 4, "ep=3 must divide dp=4"),
        ("dp=2,replicate=2", 2, "replicate=2 (HSDP) needs zero=2 or 3 (fsdp=true), got zero=0"),
        ("dp=2,zero=1", 2, "zero=1 (optimizer state only) is not offered"),
        ("dp=2,zero=4", 2, "zero=4 must be 0, 2 or 3"),
        ("dp=2,fsdp=true,zero=2", 2, "fsdp=true contradicts zero=2"),
        ("dp=2,zero=2,offload=true", 2, "offload=true needs zero=3 (FSDP2 offloads sharded parameters), got zero=2"),
        ("tp=2,zero=3,offload=true", 2, "offload=true needs dp > 1"),
        ("dp=2,param_dtype=fp16", 2, "param_dtype='fp16' is not one of bf16, fp32"),
        ("tp=2,reduce_dtype=bf16", 2, "reduce_dtype=bf16 needs dp > 1"),
        ("dp=2,sp=true", 2, "sp=true needs tp > 1"),
        ("pp=2,schedule=fast", 2, "schedule='fast' is not one of"),
        ("pp=2,schedule=interleaved,virtual=1", 2, "needs virtual >= 2"),
        ("pp=2,schedule=zbv,virtual=3,microbatches=4", 2, "uses exactly virtual=2"),
        ("pp=4,schedule=1f1b,microbatches=2", 4, "needs microbatches >= 4, got 2"),
        # DualPipe runs two micro-batches per stage (layout_rules.min_microbatches, as the planner).
        ("pp=2,schedule=dualpipev,microbatches=3", 2, "schedule=dualpipev with pp=2 needs microbatches >= 4, got 3"),
        ("dp=1,recompute=some", 1, "recompute='some' is not one of"),
        ("dp=1,recompute_layers=2", 1, "recompute_layers=2 needs recompute=full or selective"),
        ("dp=1,recompute=full,recompute_layers=-1", 1, "recompute_layers=-1 must be 0 (every block) or more"),
    ],
)
def test_invalid_plans(text, world, message):
    with pytest.raises(UserError, match=None) as error:
        plan_from_string(text, world)
    assert message in str(error.value)


def test_recompute_layers_checkpoints_only_the_first_blocks():
    from phalanx.model.by_name import model_config
    from phalanx.model.transformer import Transformer
    from phalanx.parallel.recompute import apply_recompute

    plan = plan_from_string("recompute=full,recompute_layers=3", 1)
    assert (plan.recompute, plan.recompute_layers) == ("full", 3)
    assert plan_from_string(plan.to_string(), 1) == plan
    model = apply_recompute(Transformer(model_config("tiny")), plan.recompute, plan.recompute_layers)
    wrapped = [type(block).__name__ == "CheckpointWrapper" for block in model.layers.values()]
    assert wrapped == [True, True, True, False]
