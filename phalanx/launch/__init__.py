"""Worker processes of every command, and what keeps a group of them serving.

- `worker_launch.py`: the one launcher of `phalanx train`, `serve` and `generate` (`--nproc N`):
  every worker through PyTorch's elastic launcher, all started again after a failure;
- `restart_policy.py`: the one restart policy of that launcher (`--max-restarts`, the restart's
  number and reason, one line per failure); torch-free, so the command line reads it first;
- `rank_loop.py`: the serving ranks' follow loop (ranks other than 0 run the forwards rank 0
  sends), the heartbeat that keeps an idle group within its collective timeout, and how a rank
  that lost the others says so.

Nothing here imports a command: the commands import this.
"""
