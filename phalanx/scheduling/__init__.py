"""Serving's scheduling as plain data (torch-free), below both `serve/` (which runs it) and
`planner/` (whose serving simulator runs the same code): the scheduler, the KV block manager
with its prefix cache, the latency-target policy and its step-time predictor, and the bounds
on serving counts."""
