"""Goodput under failures: `phalanx train --nproc 4` with a worker SIGKILLed every K steps,
against the same command without failures, on the same machine in the same run; and the
same failures under `--replica-groups 2` (torchft: two groups of dp=2), in the same run.

Both arms are the same command line (only `--out` differs) started as a fresh process; the
failure arm's worker is killed from outside (a child of the launcher, found in /proc), the
launcher restarts the group (`--max-restarts`), which resumes from the newest checkpoint.
Printed, per arm and as ratios:

- wall time of the command, and goodput = useful step time / wall, where useful step time is
  the sum of `step_time_s` over the run's final metrics rows (one per step). The goodput ratio
  of two arms compares the share of their wall time spent in useful steps, not their speed: a
  slower step counts as useful time too. The replica arms also print useful steps per second
  against the clean arm's, which does count it;
- steps replayed (the steps done after the checkpoint a restart resumed from, done twice),
  and what they cost at the clean arm's median step time;
- time lost per failure = (failure wall - clean wall) / kills, and the time from a kill to the
  first step row of the restarted group (restart + rendezvous + reload + that step);
- the share of the step loop spent waiting on checkpoint saves: sum of `ckpt_wait_s` over
  sum of `step_time_s` + `ckpt_wait_s`.

The arms run in pairs, in ABBA order (clean then failures, failures then clean), since the
machine's load drifts; the median goodput ratio over the pairs is the headline.

The replica-group arm (on by default, `--no-replicas` to leave it out; the `ft` extra) runs
beside each pair, a worker SIGKILLed at every multiple of K steps (K, 2K, ...: as many kills as
the restart arm, whose kills count from the step each restart resumed from). There the other group goes on stepping while the killed one restarts, so no step is
replayed; a step that only some of the R groups took part in computed only their share of the
global batch, so its useful time counts that share: useful = sum of step_time_s x
len(groups) / R. Its goodput ratio is against the same clean arm (no replica groups), so the
cost of torchft's quorum and second all-reduce at every step counts against it too.

`--replica-overhead` adds a fourth arm, the replica-group command without failures, so that
the replica arm's loss splits into what torchft costs at every step (its quorum, the second
all-reduce, the commit: this arm against clean) and what the failures cost (the replica arm
against this one).

`--saves` compares instead two failure-free arms: checkpoints saved in the loop
(`--sync-checkpoint`) against the default background saves, also in ABBA pairs: the checkpoint
wait share of each and the ratio of their wall times.

`--timeline` prints, per kill of the replica arm, the seconds from the SIGKILL to each mark of
the killed group's restart (phalanx/restart_timeline.py) and the surviving group's steps meanwhile.

Reproduce:  .venv/bin/python benchmarks/goodput.py          (issue 41's target: replica groups >= 0.9)
            .venv/bin/python benchmarks/goodput.py --replica-overhead --timeline
            .venv/bin/python benchmarks/goodput.py --no-replicas   (restarts only, as issue 11 recorded)
            .venv/bin/python benchmarks/goodput.py --saves
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from phalanx.restart_timeline import TIMELINE_ENV


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def last_step(run: Path) -> int:
    steps = [r["step"] for r in rows(run) if "loss" in r]
    return steps[-1] if steps else 0


def children(pid: int) -> list[int]:
    try:
        return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    except FileNotFoundError:
        return []


def workers(pid: int, min_depth: int = 1) -> list[int]:
    """The launcher's worker processes: its descendants without children of their own (a first
    attempt forks them from the launcher; restarts fork them from a forkserver, its child),
    but multiprocessing's resource tracker and forkservers. `min_depth` 2 with replica groups:
    the workers are below each group's launcher, and the launcher's own childless child is the
    lighthouse."""
    def cmdline(proc: int) -> bytes:
        try:
            return Path(f"/proc/{proc}/cmdline").read_bytes()
        except FileNotFoundError:
            return b""

    # A forkserver's workers carry its command line too; the forkserver is the one whose parent does not.
    found, todo = [], [(child, 1, cmdline(pid)) for child in children(pid)]
    while todo:
        proc, depth, parent = todo.pop()
        own = cmdline(proc)
        below = children(proc)
        if below:
            todo += [(child, depth + 1, own) for child in below]
            continue
        server = b"forkserver" in own and b"forkserver" not in parent
        # A replica group's forkserver forked from its launcher (phalanx/forked_forkserver.py)
        # carries the launcher's command line; before its first restart it is childless too,
        # but one thread, where a worker has torch's and gloo's.
        server = server or threads(proc) == 1
        if own and depth >= min_depth and b"resource_tracker" not in own and not server:
            found.append(proc)
    return sorted(found)


def threads(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/task").iterdir()))
    except FileNotFoundError:
        return 0


def run_arm(argv: list[str], out: Path, kill_every: int, steps: int, groups: int = 1, heartbeats: bool = False,
            timeline: bool = False) -> dict:
    """Run the command; with kill_every, SIGKILL a worker each time the run reaches the next
    multiple of kill_every steps (counted from where it resumed), before its last step. With
    `groups` > 1 (replica groups) see `run_replica_arm`."""
    if groups > 1:
        return run_replica_arm(argv, out, kill_every, steps, groups, heartbeats, timeline)
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "phalanx", *argv, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kills: list[dict] = []
    target = kill_every
    while kill_every and proc.poll() is None:
        if target < steps and last_step(out) >= target:
            victim = workers(proc.pid)[-1]
            killed_at = time.perf_counter()
            os.kill(victim, signal.SIGKILL)
            time.sleep(0.5)  # no step completes without the dead worker; the last row stands
            kills.append({"at": killed_at, "last_step": last_step(out)})
            # Wait for the restarted group's first step row, then aim at the next kill.
            while proc.poll() is None:
                restarts = [r for r in rows(out) if r.get("event") == "restart"]
                if len(restarts) == len(kills) and last_step(out) > restarts[-1]["step"]:
                    kills[-1]["resumed_from"] = restarts[-1]["step"]
                    kills[-1]["back_after_s"] = time.perf_counter() - killed_at
                    break
                time.sleep(0.01)
            if "resumed_from" not in kills[-1]:
                break  # the command ended; its status says why
            target = kills[-1]["resumed_from"] + kill_every
        time.sleep(0.01)
    _, err = proc.communicate()
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"phalanx train failed ({proc.returncode}):\n{err}")
    if kill_every:  # the launcher's line per failure
        print("\n".join(line for line in err.splitlines() if "restarting" in line), file=sys.stderr)
    steps = [r for r in rows(out) if "loss" in r]
    useful = sum(r["step_time_s"] for r in steps)
    ckpt = sum(r["ckpt_wait_s"] for r in steps)
    return {"wall": wall, "useful": useful, "ckpt": ckpt, "kills": kills, "steps": len(steps),
            "median_step": statistics.median(r["step_time_s"] for r in steps)}


def run_replica_arm(argv: list[str], out: Path, kill_every: int, steps: int, groups: int,
                    heartbeats: bool = False, timeline: bool = False) -> dict:
    """The replica-group arm: a worker of one group SIGKILLed at every multiple of kill_every
    steps (as many kills as the restart arm: none is replayed here to push the next one later),
    each once the group killed before has rejoined. A group killed near the end may not be back
    before the other finishes; it then finds the final checkpoint and ends. Per kill, the time
    to the next step row (the surviving groups' next committed step) and to the rejoin row.
    `heartbeats`: also poll the lighthouse's status page (`LighthouseAges`); `timeline`: the
    workers' and launchers' marks (phalanx/restart_timeline.py), with a line of this process's at
    each kill, for `report_timeline`."""
    began = time.perf_counter()
    marks = out.parent / f"{out.name}.timeline"
    env = {**os.environ, TIMELINE_ENV: str(marks)} if timeline and kill_every else None
    proc = subprocess.Popen([sys.executable, "-m", "phalanx", *argv, "--replica-groups", str(groups), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    err_lines: list[str] = []
    ages = LighthouseAges() if heartbeats else None

    def read_stderr() -> None:  # read as it comes: the lighthouse's address is on its first lines
        for line in proc.stderr:
            err_lines.append(line)
            if ages is not None and (found := re.search(r"torchft lighthouse at (\S+)", line)):
                ages.start(found.group(1), proc)
    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    kills: list[dict] = []
    target = kill_every
    while kill_every and proc.poll() is None:
        if target < steps and last_step(out) >= target:
            victim = workers(proc.pid, min_depth=2)[-1]
            killed_at, killed_unix = time.perf_counter(), time.time()
            os.kill(victim, signal.SIGKILL)
            if env is not None:
                with marks.open("a") as file:
                    file.write(f"{killed_unix:.4f} {victim} - kill\n")
            kills.append({"at": killed_at, "last_step": last_step(out)})
            while proc.poll() is None:
                if "next_step_after_s" not in kills[-1] and last_step(out) > kills[-1]["last_step"]:
                    kills[-1]["next_step_after_s"] = time.perf_counter() - killed_at
                rejoined = [r for r in rows(out) if r.get("event") == "group_rejoined"]
                if len(rejoined) == len(kills):
                    kills[-1]["rejoined_at_step"] = rejoined[-1]["step"]
                    kills[-1]["back_after_s"] = time.perf_counter() - killed_at
                    kills[-1].setdefault("next_step_after_s", kills[-1]["back_after_s"])
                    break
                time.sleep(0.01)
            if "rejoined_at_step" not in kills[-1]:
                break  # the run ended before the group came back (or failed: its status says)
            target = max(target + kill_every, kills[-1]["rejoined_at_step"] + 1)
        time.sleep(0.01)
    proc.wait()
    reader.join()
    wall = time.perf_counter() - began
    err = "".join(err_lines)
    if proc.returncode != 0:
        raise SystemExit(f"phalanx train --replica-groups failed ({proc.returncode}):\n{err}")
    if kill_every:  # the launchers' line per failure
        print("\n".join(line for line in err.splitlines() if "restarting" in line), file=sys.stderr)
    steps_rows = [r for r in rows(out) if "loss" in r]
    useful = sum(r["step_time_s"] * len(r["groups"]) / groups for r in steps_rows)
    alone = sum(1 for r in steps_rows if len(r["groups"]) < groups)
    return {"wall": wall, "useful": useful, "useful_steps": sum(len(r["groups"]) / groups for r in steps_rows), "ckpt": sum(r["ckpt_wait_s"] for r in steps_rows), "kills": kills,
            "steps": len(steps_rows), "short_steps": alone,
            "median_step": statistics.median(r["step_time_s"] for r in steps_rows),
            "heartbeat_ages": ages.stop() if ages is not None else None,
            "timeline": marks.read_text() if env is not None and marks.exists() else None}


class LighthouseAges:
    """Polls the lighthouse's status page (every `EVERY_S`) for how long ago it last heard from
    each group: a live group's largest age before its next heartbeat is how late heartbeats
    come on this machine under this load, what the lighthouse's heartbeat timeout must exceed
    (phalanx/parallel/fault_tolerance.py). A dead group's age only grows: never counted. The
    poll sees an age up to EVERY_S (plus its own delay) before the next heartbeat lands, so the
    largest age is a little under the true largest gap."""

    EVERY_S = 0.01

    def __init__(self) -> None:
        self.samples: list[tuple[str, float]] = []
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, url: str, proc) -> None:
        def poll() -> None:
            while not self.done.is_set() and proc.poll() is None:
                try:
                    page = urllib.request.urlopen(f"{url}/status", timeout=2).read().decode()
                except OSError:
                    page = ""
                for replica, age, unit in re.findall(r"(phalanx_group_\S+): seen ([0-9.]+)(m?s) ago", page):
                    self.samples.append((replica, float(age) / (1000 if unit == "ms" else 1)))
                time.sleep(self.EVERY_S)
        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()

    def stop(self) -> dict:
        """{"largest_s": the largest age of a live group seen before its next heartbeat, "polls": how many}."""
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        last: dict[str, float] = {}
        largest = 0.0
        for replica, age in self.samples:
            if age < last.get(replica, 0.0):  # it heartbeat again: the age before was a live group's gap
                largest = max(largest, last[replica])
            last[replica] = age
        return {"largest_s": largest, "polls": len(self.samples)}


def report_replicas(clean: dict, arm: dict) -> float:
    """Print the replica-group arm against the pair's clean arm; its goodput ratio."""
    kills = arm["kills"]
    backs = [k["back_after_s"] for k in kills if "back_after_s" in k]
    back = statistics.mean(backs) if backs else 0.0
    print(f"  replicas  wall {arm['wall']:6.1f} s  useful step time {arm['useful']:6.1f} s  "
          f"goodput {arm['useful'] / arm['wall']:.3f}  ({arm['steps']} step rows, {arm['short_steps']} of them "
          f"without the killed group; median step {arm['median_step'] * 1e3:.0f} ms)")
    print(f"  {len(kills)} kills, {len(backs)} rejoins before the end; no step replayed; kill -> the group's rejoin "
          f"{back:.1f} s (its restart, the quorum and the state received from its peer)")
    if kills:
        print("  per kill: kill -> the next step row (the surviving group's next committed step) / -> the rejoin row: "
              + ", ".join(f"{k['next_step_after_s']:.2f} / {k['back_after_s']:.2f} s" if "back_after_s" in k
                          else "(no rejoin before the end)" for k in kills))
    if arm.get("timeline"):
        report_timeline(arm["timeline"])
    if arm.get("heartbeat_ages"):
        ages = arm["heartbeat_ages"]
        print(f"  lighthouse: the largest heartbeat age of a live group {ages['largest_s'] * 1e3:.0f} ms "
              f"({ages['polls']} polls of its status page)")
    ratio = arm["useful"] / arm["wall"] / (clean["useful"] / clean["wall"])
    print(f"  goodput replica groups with failures / clean = {ratio:.3f}; wall / clean = {arm['wall'] / clean['wall']:.3f}; "
          f"useful steps per second / clean = {steps_per_second(arm) / steps_per_second(clean):.3f}")
    return ratio


TIMELINE_MARKS = [
    ("sibling_dead", "the killed group's watch finds its dead sibling"),
    ("attempt_failed", "its launcher sees the attempt fail"),
    ("attempt_start", "its launcher starts the restart"),
    ("worker_start", "the new workers start (their first line)"),
    ("process_group_up", "their process group is up"),
    ("model_built", "their model and optimizer are built"),
    ("manager_start", "their torchft manager starts"),
    ("manager_up", "... is up"),
    ("quorum_ask", "they ask for their first quorum"),
    ("quorum_done", "their first quorum (state received)"),
    ("step_done", "their first committed step"),
]


def report_timeline(text: str) -> None:
    """Per kill, seconds from the SIGKILL to each mark of the killed group (first and last of
    its processes), and the surviving groups' marks until the rejoin: their broken all-reduce,
    their new quorum and each step they committed (its step_time_s and the groups in it)."""
    lines = sorted((float(t), pid, group, what, " ".join(rest)) for t, pid, group, what, *rest in
                   (line.split(" ", 4) for line in text.splitlines() if line.strip()))
    kills = [i for i, line in enumerate(lines) if line[3] == "kill"]
    for number, start in enumerate(kills):
        end = kills[number + 1] if number + 1 < len(kills) else len(lines)
        t0, window = lines[start][0], lines[start + 1:end]
        failed = next((line[2] for line in window if line[3] == "attempt_failed"), None)
        if failed is None:
            print(f"  kill {number + 1}: no failed attempt marked")
            continue
        restarted = next((line[0] for line in window if line[3] == "attempt_start" and line[2] == failed), None)
        ours = [line for line in window if line[2] == failed and (restarted is None or line[3] in ("sibling_dead", "attempt_failed")
                                                                     or line[0] >= restarted)]
        back = next((line[0] for line in ours if line[3] == "step_done"), None)
        print(f"  kill {number + 1} (group {failed}): seconds after the SIGKILL")
        for name, words in TIMELINE_MARKS:
            firsts: dict[str, float] = {}
            for line in ours:
                if line[3] == name:
                    firsts.setdefault(line[1], line[0] - t0)
            if firsts:
                low, high = min(firsts.values()), max(firsts.values())
                print(f"    {low:5.2f}{'' if high - low < 0.005 else f'-{high:.2f}'}  {words}")
        others = [line for line in window if line[2] not in (failed, "-") and (back is None or line[0] <= back + 1e-3)
                  and line[3] in ("allreduce_broken", "quorum_again", "step_done")]
        seen: set[tuple[str, str]] = set()
        survivor = []
        for line in others:  # the first process of the surviving groups to mark each speaks for them
            key = (line[2], line[3], line[4].split()[0] if line[3] == "step_done" else "")
            if key in seen:
                continue
            seen.add(key)
            survivor.append(f"{line[0] - t0:.2f} {line[3]}" + (f" {line[4]}" if line[4] else ""))
        print("    survivors: " + "; ".join(survivor))


def steps_per_second(arm: dict) -> float:
    """Useful steps per second of wall time (a replica step counts the share of groups in it):
    unlike goodput, a slower step counts against it."""
    return arm.get("useful_steps", arm["steps"]) / arm["wall"]


def report_replica_overhead(clean: dict, quiet: dict, failing: dict) -> None:
    """The replica groups without failures against clean (torchft's cost at every step) and the
    replica arm against them (the failures' cost)."""
    goodput = {name: arm["useful"] / arm["wall"] for name, arm in (("clean", clean), ("quiet", quiet), ("failing", failing))}
    print(f"  replicas without failures  wall {quiet['wall']:6.1f} s  useful step time {quiet['useful']:6.1f} s  goodput "
          f"{goodput['quiet']:.3f}  (median step {quiet['median_step'] * 1e3:.0f} ms against the clean arm's "
          f"{clean['median_step'] * 1e3:.0f} ms)")
    print(f"  goodput replica groups without failures / clean = {goodput['quiet'] / goodput['clean']:.3f} (torchft at every "
          f"step); with failures / without = {goodput['failing'] / goodput['quiet']:.3f} (the failures); useful steps per "
          f"second without failures / clean = {steps_per_second(quiet) / steps_per_second(clean):.3f}")
    if quiet.get("heartbeat_ages"):
        ages = quiet["heartbeat_ages"]
        print(f"  lighthouse, without failures: the largest heartbeat age of a live group {ages['largest_s'] * 1e3:.0f} ms "
              f"({ages['polls']} polls of its status page)")


def report(args, clean: dict, faulty: dict) -> float:
    """Print one pair of arms; return its goodput ratio (failures / clean)."""
    kills = faulty["kills"]
    for name, arm in (("clean", clean), ("failures", faulty)):
        print(f"  {name:9s} wall {arm['wall']:6.1f} s  useful step time {arm['useful']:6.1f} s  "
              f"goodput {arm['useful'] / arm['wall']:.3f}  checkpoint wait share "
              f"{arm['ckpt'] / (arm['useful'] + arm['ckpt']):.3f}  ({arm['steps']} step rows)")
    replayed = [k["last_step"] - k["resumed_from"] for k in kills]
    lost = (faulty["wall"] - clean["wall"]) / max(len(kills), 1)
    back = statistics.mean(k["back_after_s"] for k in kills) if kills else 0.0
    print(f"  {len(kills)} kills; steps replayed per failure {', '.join(map(str, replayed))} "
          f"(replay ~{statistics.mean(replayed or [0]) * clean['median_step']:.1f} s at the median step of "
          f"{clean['median_step'] * 1e3:.0f} ms)")
    print(f"  time lost per failure (wall difference / kills) {lost:.1f} s; kill -> first step row of the "
          f"restarted group {back:.1f} s (restart + reload + that step)")
    ratio = faulty["useful"] / faulty["wall"] / (clean["useful"] / clean["wall"])
    print(f"  goodput failures / clean = {ratio:.3f}; wall failures / clean = {faulty['wall'] / clean['wall']:.3f}")
    return ratio


def compare_saves(argv: list[str], pairs: int) -> None:
    """Failure-free arms with checkpoints saved in the loop and in the background."""
    walls = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(pairs):
            arms = {}
            for kind in (("sync", "async") if pair % 2 == 0 else ("async", "sync")):
                extra = ["--sync-checkpoint"] if kind == "sync" else []
                arms[kind] = run_arm([*argv, *extra], Path(tmp) / f"{kind}-{pair}", 0, 0)
            print(f"pair {pair + 1} ({' then '.join(arms)}):")
            for kind, arm in arms.items():
                print(f"  {kind:6s} wall {arm['wall']:6.1f} s  checkpoint wait {arm['ckpt']:5.2f} s, share of the step loop "
                      f"{arm['ckpt'] / (arm['useful'] + arm['ckpt']):.3f}  ({arm['steps']} step rows)")
            walls.append(arms["async"]["wall"] / arms["sync"]["wall"])
            print(f"  wall background / in the loop = {walls[-1]:.3f}")
    print(f"wall background / in the loop, median of {len(walls)} pairs: {statistics.median(walls):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-every", type=int, default=18,
                        help="steps between kills, counted from the step resumed from (not a multiple of "
                             "--ckpt-every, so that each failure replays steps)")
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", default="128")
    parser.add_argument("--plan", default="dp=4")
    parser.add_argument("--pairs", type=int, default=2, help="clean/failure pairs, in ABBA order against drift")
    parser.add_argument("--replica-plan", default="dp=2", help="the plan of each of the 2 replica groups (2 processes each)")
    parser.add_argument("--no-replicas", dest="replicas", action="store_false",
                        help="leave out the replica-group arm (--replica-groups 2, torchft)")
    parser.add_argument("--replica-overhead", action="store_true",
                        help="also run the replica-group command without failures (torchft's cost at every step)")
    parser.add_argument("--heartbeats", action="store_true",
                        help="poll the lighthouse's status page in the replica arms: the largest heartbeat age of a "
                             "live group (what the heartbeat timeout must exceed)")
    parser.add_argument("--timeline", action="store_true",
                        help="per kill of the replica arm, the seconds from the SIGKILL to each mark of the killed group's "
                             "restart and the surviving group's steps meanwhile (phalanx/restart_timeline.py)")
    parser.add_argument("--saves", action="store_true",
                        help="compare synchronous and background checkpoint saves (no failures) instead")
    args = parser.parse_args()
    failures = (args.steps - 1) // args.kill_every
    argv = ["train", "--model", args.model, "--nproc", "4", "--plan", args.plan, "--steps", str(args.steps),
            "--global-batch", "16", "--seq-len", args.seq_len, "--ckpt-every", str(args.ckpt_every), "--eval-every", "0",
            "--sample-tokens", "0", "--no-progress", "--device", "cpu", "--max-restarts", str(failures + 1)]
    print(f"model {args.model}, plan {args.plan} on 4 CPU processes, {args.steps} steps, checkpoint every "
          f"{args.ckpt_every}, " + ("no failures: checkpoints saved in the loop against in the background" if args.saves else
                                    f"a worker SIGKILLed every {args.kill_every} steps after the step resumed from"))
    if args.saves:
        compare_saves(argv, args.pairs)
        return
    ratios, replica_ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            arms = {}
            order = (["clean", "failures"] + (["replicas"] if args.replicas else [])
                     + (["replicas-quiet"] if args.replicas and args.replica_overhead else []))
            for kind in (order if pair % 2 == 0 else order[::-1]):
                replicas = kind.startswith("replicas")
                arm_argv = argv if not replicas else [args.replica_plan if a == args.plan else a for a in argv]
                arms[kind] = run_arm(arm_argv, Path(tmp) / f"{kind}-{pair}",
                                     0 if kind in ("clean", "replicas-quiet") else args.kill_every, args.steps,
                                     groups=2 if replicas else 1, heartbeats=args.heartbeats, timeline=args.timeline)
            print(f"pair {pair + 1} ({' then '.join(arms)}):")
            ratios.append(report(args, arms["clean"], arms["failures"]))
            if args.replicas:
                replica_ratios.append(report_replicas(arms["clean"], arms["replicas"]))
            if "replicas-quiet" in arms:
                report_replica_overhead(arms["clean"], arms["replicas-quiet"], arms["replicas"])
    print(f"goodput ratio failures / clean, median of {len(ratios)} pairs: {statistics.median(ratios):.3f}")
    if replica_ratios:
        print(f"goodput ratio replica groups with failures / clean, median of {len(replica_ratios)} pairs: "
              f"{statistics.median(replica_ratios):.3f}")


if __name__ == "__main__":
    main()
