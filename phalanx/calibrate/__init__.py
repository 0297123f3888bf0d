"""`phalanx calibrate`: measure this machine and write the cluster file `--cluster local` reads.

The planner only reads cluster files; everything that starts processes or imports torch,
`parallel/` or `train/` lives here.

workers.py   timers, gloo worker groups (restarted once on a hang), collectives, the machine's share
compute.py   matrix multiplies, attention, memory bandwidth, the real layer's training steps
wrappers.py  FSDP and tensor parallelism per block on 2 processes
runtimes.py  DDP, FSDP under pp, the pipeline runtime and tp's step costs on the trainer's code
fit.py       measurements -> cluster figures (torch-free, tested on synthetic samples)
command.py   `calibrate()`: run them all, print each figure, write the files
cli.py       the `phalanx calibrate` subcommand (argparse only)
"""
