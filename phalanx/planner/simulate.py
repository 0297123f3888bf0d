"""Simulated timeline of one step, per pipeline rank, as a Chrome trace and a PNG.

The cost model gives one micro-batch's forward (F), input-gradient (B) and weight-gradient
(W) times on the most loaded stage; here every pipeline rank runs its chunks' operations
under the schedule's rules and a list scheduler places them in time:

  an operation starts when its rank is free and its input has arrived (the previous virtual
  stage's F, the next one's B, plus the point-to-point send when ranks differ);
  among ready operations a rank prefers B, then F, and starts a new forward only while it
  holds fewer micro-batches than the schedule allows (1F1B: p - rank); interleaved runs
  Megatron's op order, zbv PyTorch's ZB-V order and dualpipev DeepSeek's DualPipeV order
  (pipeline_orders.py), each rank its own order, with W where the order puts it.

Ranks that differ only in their dp or tp index do the same thing at the same time, so one
row is drawn per pipeline rank. TP/EP traffic sits inside F and B (on the comm track),
then the data-parallel reduce and the optimizer close the step. Gaps are drawn as idle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import UserError
from phalanx.output_path import check_output_folder
from phalanx.planner import comm
from phalanx.planner.cost import BF16, Estimate
from phalanx.planner.energy import busy_seconds, check_prices, cost_usd_per_mtok, energy_per_step_j, parse_prices
from phalanx.planner.hardware import cluster_from_name
from phalanx.planner.layout import Workload
from phalanx.planner.model_spec import model_from_name
from phalanx.planner.pipeline_orders import dualpipev_order, run_fixed_orders, zbv_order
from phalanx.planner.plan_flags import add_plan_flags, options_for
from phalanx.planner.search import SearchSpace, fix_problems, parse_fix, search

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "R": "#8172B2", "idle": "#DDDDDD",
          "tp/ep comm": "#C44E52", "send": "#937860", "dp comm": "#DA8BC3", "optimizer": "#8C8C8C"}


@dataclass(frozen=True, kw_only=True)
class Event:
    rank: int
    """Pipeline rank."""
    track: str
    """'compute' or 'comm'."""
    name: str
    kind: str
    start: float
    end: float


def _placement(schedule: str, p: int, v: int) -> list[tuple[int, int]]:
    """Virtual stage j -> (pipeline rank, chunk on that rank)."""
    if schedule in ("zbv", "dualpipev"):
        return [(j, 0) if j < p else (2 * p - 1 - j, 1) for j in range(2 * p)]
    return [(j % p, j // p) for j in range(p * v)]


def _forward_limit(schedule: str, rank: int, p: int, v: int, m: int) -> int:
    """Micro-batches a rank may have started (first chunk's F) but not finished (first chunk's B).

    1F1B: p - rank. Interleaved: Megatron's warm-up of (p - rank - 1) * 2 + (v - 1) * p chunk
    forwards, in micro-batches. (zbv and dualpipev run fixed orders, `_v_timeline`.)
    """
    if p == 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        # Megatron issues chunk forwards in groups of p micro-batches per chunk; count the
        # chunk-0 (new micro-batch) forwards among the warm-up ones plus the first steady one.
        n = min(m * v, (p - rank - 1) * 2 + (v - 1) * p + 1)
        return (n // (p * v)) * p + min(n % (p * v), p)
    return p - rank


def _megatron_interleaved_order(rank: int, p: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """Megatron's op order on one rank: (kind, micro-batch, virtual stage)."""
    fwd, bwd = [], []
    for group in range(0, m, p):
        mbs = range(group, min(group + p, m))
        fwd += [(mb, c * p + rank) for c in range(v) for mb in mbs]
        bwd += [(mb, c * p + rank) for c in reversed(range(v)) for mb in mbs]
    warmup = min(len(fwd), (p - rank - 1) * 2 + (v - 1) * p)
    order = [("F", mb, j) for mb, j in fwd[:warmup]]
    for i in range(len(fwd) - warmup):
        order += [("F", *fwd[warmup + i]), ("B", *bwd[i])]
    order += [("B", mb, j) for mb, j in bwd[len(fwd) - warmup:]]
    return order


def pipeline_timeline(est: Estimate, send_s: float) -> tuple[list[Event], float]:
    """Place every F/B (and W) of one step in time; return the events and when the last ends."""
    lay = est.layout
    p, m = lay.pp, lay.microbatches
    if lay.schedule in ("zbv", "dualpipev") and p > 1:
        return _v_timeline(est, send_s)
    v = lay.virtual
    st = est.stage
    dur = {"F": st.f / v, "B": (st.b + st.r + st.w) / v}
    comm_share = {"F": st.f_comm / v, "B": (st.b_comm + st.r_comm) / v, "W": 0.0}
    place = _placement(lay.schedule if p > 1 else "1f1b", p, v)
    n_virtual = len(place)
    orders = None
    if lay.schedule == "interleaved" and p > 1:
        orders = [_megatron_interleaved_order(r, p, v, m) for r in range(p)]
    position = [0] * p
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) -> end time
    next_mb = {(k, j): 0 for k in "FB" for j in range(n_virtual)}
    free = [0.0] * p
    held = [0] * p
    limit = [_forward_limit(lay.schedule, r, p, v, m) for r in range(p)]
    events: list[Event] = []

    def ready_time(kind: str, mb: int, j: int) -> float | None:
        rank = place[j][0]
        if kind == "F":
            if j == 0:
                return 0.0
            t = done.get(("F", mb, j - 1))
            return None if t is None else t + (send_s if place[j - 1][0] != rank else 0.0)
        if j == n_virtual - 1:
            return done.get(("F", mb, j))
        t = done.get(("B", mb, j + 1))
        return None if t is None else t + (send_s if place[j + 1][0] != rank else 0.0)

    def options():
        if orders is not None:  # a fixed order per rank: only its next op may start
            for rank in range(p):
                if position[rank] < len(orders[rank]):
                    yield orders[rank][position[rank]]
            return
        for j, (rank, chunk) in enumerate(place):
            for kind in "FB":
                mb = next_mb[(kind, j)]
                if mb < m and not (kind == "F" and chunk == 0 and held[rank] >= limit[rank]):
                    yield kind, mb, j

    priority = {"B": 0, "F": 1}
    for _ in range(n_virtual * m * 2):
        best = None
        for kind, mb, j in options():
            t = ready_time(kind, mb, j)
            if t is None:
                continue
            start = max(t, free[place[j][0]])
            # Earliest start first; then B before F; deeper chunks first (finish micro-batches).
            key = (start, priority[kind], -j if kind == "F" else j, mb)
            if best is None or key < best[0]:
                best = (key, kind, mb, j, start)
        if best is None:
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in the simulator")
        _, kind, mb, j, start = best
        rank, chunk = place[j]
        end = start + dur[kind]
        done[(kind, mb, j)] = end
        next_mb[(kind, j)] += 1
        if orders is not None:
            position[rank] += 1
        free[rank] = end
        if chunk == 0:
            held[rank] += 1 if kind == "F" else -1
        events.append(Event(rank=rank, track="compute", name=f"{kind} mb{mb} chunk{chunk}", kind=kind,
                            start=start, end=end))
        if comm_share[kind] > 0:
            events.append(Event(rank=rank, track="comm", name="tp/ep comm", kind="tp/ep comm",
                                start=end - comm_share[kind], end=end))
        neighbour = j + 1 if kind == "F" else j - 1
        if 0 <= neighbour < n_virtual and place[neighbour][0] != rank and send_s > 0:
            what = "act" if kind == "F" else "grad"
            events.append(Event(rank=rank, track="comm", name=f"send {what} mb{mb}", kind="send", start=end,
                                end=end + send_s))
    return events, max(e.end for e in events if e.track == "compute")


def _v_timeline(est: Estimate, send_s: float) -> tuple[list[Event], float]:
    """zbv and dualpipev, each in its own order (pipeline_orders.py): chunks of half a stage,
    weight gradients where the schedule puts them."""
    lay, st = est.layout, est.stage
    p, m = lay.pp, lay.microbatches
    order = zbv_order if lay.schedule == "zbv" else dualpipev_order
    dur = {"F": st.f / 2, "B": (st.b + st.r + st.w) / 2, "I": (st.b + st.r) / 2, "W": st.w / 2}
    comm_share = {"F": st.f_comm / 2, "B": (st.b_comm + st.r_comm) / 2, "I": (st.b_comm + st.r_comm) / 2, "W": 0.0}
    place = _placement(lay.schedule, p, 2)
    ops = run_fixed_orders([order(r, p, m) for r in range(p)], place, dur, send_s)
    events = []
    for rank, kind, mb, j, start, end in ops:
        shown = "B" if kind == "I" else kind
        events.append(Event(rank=rank, track="compute", name=f"{kind} mb{mb} chunk{place[j][1]}", kind=shown,
                            start=start, end=end))
        if comm_share[kind] > 0:
            events.append(Event(rank=rank, track="comm", name="tp/ep comm", kind="tp/ep comm",
                                start=end - comm_share[kind], end=end))
        neighbour = j + 1 if kind == "F" else j - 1
        if kind != "W" and 0 <= neighbour < len(place) and place[neighbour][0] != rank and send_s > 0:
            what = "act" if kind == "F" else "grad"
            events.append(Event(rank=rank, track="comm", name=f"send {what} mb{mb}", kind="send", start=end,
                                end=end + send_s))
    return events, max(e.end for e in events if e.track == "compute")


def simulate(est: Estimate, cluster) -> tuple[list[Event], float]:
    """Events of one whole step (pipeline, DP traffic, optimizer, idle) and its length."""
    lay = est.layout
    send_s = 0.0
    if lay.pp > 1:
        nbytes = lay.mbs * est.seq_len * est.hidden_size * BF16 / (lay.tp if lay.sp else 1)
        send_s = comm.send(cluster, nbytes, same_domain=lay.tp * lay.replicas * 2 <= cluster.fast_domain)
    events, pipeline_end = pipeline_timeline(est, send_s)
    ends = []
    for rank in range(lay.pp):
        last = max(e.end for e in events if e.rank == rank and e.track == "compute")
        t = last
        if est.breakdown["dp_comm"] > 0:
            events.append(Event(rank=rank, track="comm", name="dp grad reduce (exposed)", kind="dp comm",
                                start=t, end=t + est.breakdown["dp_comm"]))
            t += est.breakdown["dp_comm"]
        events.append(Event(rank=rank, track="compute", name="optimizer", kind="optimizer", start=t,
                            end=t + est.breakdown["optimizer"]))
        ends.append(t + est.breakdown["optimizer"])
    step = max(ends)
    for rank in range(lay.pp):  # idle gaps on the compute track
        spans = sorted((e.start, e.end) for e in events if e.rank == rank and e.track == "compute")
        cursor = 0.0
        for start, end in spans + [(step, step)]:
            if start - cursor > 1e-12:
                events.append(Event(rank=rank, track="compute", name="idle", kind="idle", start=cursor, end=start))
            cursor = max(cursor, end)
    return events, step


def write_chrome_trace(events: list[Event], path: Path, *, ranks_per_stage: int, title: str) -> None:
    """Chrome trace-event JSON (microseconds), one process per pipeline rank: Perfetto opens it."""
    out = [{"name": "process_name", "ph": "M", "pid": r, "args": {
        "name": f"pipeline rank {r} (global rank {r * ranks_per_stage}; its dp x tp peers match it)"}}
        for r in sorted({e.rank for e in events})]
    for e in events:
        out.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": e.rank, "tid": e.track,
                    "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6})
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"title": title}}))


def write_png(events: list[Event], path: Path, *, title: str) -> None:
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    import matplotlib

    matplotlib.use("Agg")
    # Imported when run, not at the top: it brings in matplotlib, which start-up need not wait for.
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({e.rank for e in events})
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.6 * len(ranks)))
    for e in events:
        y = ranks.index(e.rank) + (0.0 if e.track == "compute" else 0.42)
        height = 0.4 if e.track == "compute" else 0.18
        ax.broken_barh([(e.start, e.end - e.start)], (y, height), facecolors=COLORS[e.kind], linewidth=0)
    ax.set_yticks([i + 0.3 for i in range(len(ranks))], [f"pp rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    used = sorted({e.kind for e in events}, key=list(COLORS).index)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in used], loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(ranks) < 4 else -0.1), ncol=len(used), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(subparsers) -> None:
    """Add `simulate` to an argparse subparsers object."""
    s = subparsers.add_parser("simulate", help="timeline of one step per rank: Chrome trace + PNG")
    add_plan_flags(s)
    s.add_argument("--cluster", default="local")
    s.add_argument("--plan", required=True, help="layout (--plan grammar plus mbs=, zero=); the rest is searched")
    s.add_argument("--out", default="simulation", help="output directory for trace.json and timeline.png")
    s.add_argument("--serve", action="store_true",
                   help="simulate serving instead (its own flags: phalanx simulate --serve --help; docs/serve_planner.md)")
    s.set_defaults(func=simulate_command)


def simulate_command(args) -> int:
    check_output_folder(args.out, "--out")  # before the search and the simulation
    model = model_from_name(args.model)
    cluster = cluster_from_name(args.cluster)
    workload = Workload(global_batch=args.global_batch, seq_len=args.seq_len)
    prices = parse_prices(args.price)
    check_prices(prices, [cluster])
    fixed = parse_fix(args.plan)
    dp, tp, pp = (int(fixed.get(k, 1)) for k in ("dp", "tp", "pp"))
    result = search(model, cluster, workload, world_size=dp * tp * pp, fixed={**fixed, "dp": dp, "tp": tp, "pp": pp},
                    space=SearchSpace(zero_levels=args.zero_levels, phalanx_trainer=not args.any_runtime),
                    options=options_for(args, cluster), keep=1)
    if not result.ranked and result.considered == 0:  # say why, not "0 considered"
        reasons = fix_problems(model, workload, dp * tp * pp, {**fixed, "dp": dp, "tp": tp, "pp": pp},
                               SearchSpace(), expert_slots=args.expert_slots)
        slots = f" with --expert-slots={args.expert_slots}" if args.expert_slots else ""
        raise UserError(f"--plan {args.plan} gives no layout{slots}: " + ("; ".join(reasons) if reasons else
                        f"none of {model.name}'s shapes, global batch {args.global_batch} and the plan's sizes fit together"))
    if not result.ranked:
        raise UserError(f"--plan {args.plan} gives no layout that fits ({result.considered} considered, "
                        f"{result.pruned_memory} pruned for memory)")
    est = result.ranked[0]
    events, step = simulate(est, cluster)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{model.name} on {cluster.name}: {est.layout.to_string()}"
    write_chrome_trace(events, out / "trace.json", ranks_per_stage=est.layout.replicas * est.layout.tp, title=title)
    write_png(events, out / "timeline.png", title=title)
    print(f"layout: {est.layout.to_string()}")
    print(f"simulated step {step:.4g} s; cost model {est.step_time_s:.4g} s")
    energy = energy_per_step_j(est, cluster)
    if energy is not None:  # of the cost model's step (energy.py), not the simulated timeline's
        print(f"predicted energy {energy / 1e3:.4g} kJ per step, {energy / est.tokens:.4g} J/token "
              f"(busy {busy_seconds(est) / est.step_time_s:.0%} of the step)")
    if price := prices.get(cluster.name):
        print(f"predicted cost ${cost_usd_per_mtok(est, price):.4g} per million tokens at ${price:g} per GPU hour")
    print(f"wrote {out / 'trace.json'} (open in https://ui.perfetto.dev) and {out / 'timeline.png'}")
    return 0
