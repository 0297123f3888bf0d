"""The planner's serving half: which layout serves a model best on N GPUs, torch-free.

It stands on the planner's shared core (phalanx/planner: hardware.py, comm.py,
model_spec.py, latent_attention.py, stage_time.gemm_time) beside the training half, and on
serving's own scheduler (phalanx/scheduling), whose very code the simulator runs.

costs.py        what an engine costs per step beyond FLOPs and bytes, and where each figure comes from
step.py         one engine step on one rank: weights and GEMMs, attention, tp/ep/pp traffic, framework
memory.py       a rank's weights, working memory and KV cache, hence the running batch it holds
rates.py        TTFT, TPOT, tokens/s and goodput of a layout under a load, in closed form
expert_load.py  expert slots: the load skew (--expert-load), slot counts, the imbalance left
search.py       every layout of N GPUs, rated and ranked; `parse_serve_fix` (--fix's serving keys)
disagg.py       prefill/decode disaggregation: splits, each side's layout, KV transfer
simulate.py     a discrete-event run of one instance with phalanx serve's scheduler
fit.py          fitting costs.py's constants to steps and latencies measured on this machine
flags.py        the flags plan --serve and simulate --serve share
report.py       the JSON records, the table, the phalanx serve command of each plan
sim_report.py   simulate --serve: the sweep, the trace and the plots
cli.py          plan --serve and simulate --serve
validation.json the published serving runs the planner is checked on (benchmarks/serve_planner_published.py)
"""
