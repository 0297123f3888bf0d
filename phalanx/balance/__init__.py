"""Expert placement: replicate hot experts and spread the replicas so every GPU carries about the
same load (`phalanx balance`, docs/balance.md).

torch-free: `solve.rebalance` is the core; `eplb.rebalance_experts` wraps it with DeepSeek EPLB's
torch-tensor signature. Nothing is imported here, so the CLI can register the command cheaply.
"""
