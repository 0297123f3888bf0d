"""The planner: pick a parallel layout from a cluster description and a model's shape.

hardware.py  cluster description: the hardware (presets, TOML/JSON files)
framework_costs.py  the measured framework overheads a cluster file may carry
model_spec.py  model description (presets, project JSON, Hugging Face config.json)
layout.py  a candidate: the trainer's Plan plus the micro-batch size and the planner-only ZeRO-1; the workload
comm.py  alpha-beta collective times on the two link levels
kv_cache.py  a model's KV cache per token on one tp rank (phalanx serve's paged cache sizes by it too)
memory.py  parameter, optimizer-state and activation bytes
peak_memory.py  a candidate's peak bytes per device by cause (priced before its time)
pipeline_orders.py  zbv's and dualpipev's order of operations per rank, timed
dp_traffic.py  data-parallel collectives per ZeRO level, and how much of them compute hides
stage_time.py  one micro-batch through the most loaded stage: GEMMs, attention, TP and EP traffic
options.py  the implementation: `Options` (published runs' defaults) and `trainer_options` (a phalanx run)
cost.py  the whole step: bubble, pipeline sends, DP traffic, optimizer; memory beside it
search.py  enumerate layouts, prune by memory, rank; `auto_plan` for the trainer
report.py  the plan table, the JSON records and why the runners-up lose
simulate.py  per-rank timeline of one step as a Chrome trace and a PNG
plan_flags.py  the flags `plan` and `simulate` share, and the `Options` they name
cli.py  the `plan` subcommand (simulate.py and phalanx/calibrate/cli.py register their own)
serve/  the serving half (plan --serve, simulate --serve): its own package on this shared core

Nothing here needs torch: planning a 400B model runs on a laptop. Measuring a machine is
`phalanx.calibrate`'s job; the planner only reads the cluster files it writes. The rules of a
layout (tp divides heads, micro-batches per schedule, ...) are in `phalanx.layout_rules`.
"""
