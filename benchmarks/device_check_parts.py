"""The parts of benchmarks/device_check.sh: for each, the command it runs (on the GPU, or at
tiny sizes on the CPU for --dry-run) and how the figures are read back from what the command
printed. The runner (device_check.py) times, bounds and records them.

Each part's command is one of the benchmark scripts, so its figures are what that script
prints; the readers below follow the scripts' output lines, and the dry run (tests/
test_device_check.py) fails when a script's lines change and a reader no longer finds them.
Parts that need a flag or a script another change adds (`--compile`, `--float8`,
`benchmarks/serve_load.py`) look for it at run time and say "not in this build" without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
NOT_IN_BUILD = "not in this build"
DRY_RUN_TIMEOUT_S = 240
"""Each part's bound in a dry run: its work is a few CPU seconds, but a shared machine's load
can stretch that tenfold, and a part that times out there tests nothing."""


@dataclass
class Context:
    """What every part's command depends on."""
    dry_run: bool
    cluster: str
    """The planner's --cluster for this device (a preset, or `local` on the CPU)."""
    workdir: Path
    """The output folder: the planner's model file goes there, so its command can be rerun."""
    budget_s: float = 0.0
    """All parts together, seconds (for the message of a part the budget left out)."""
    deadline: float = float("inf")
    """time.perf_counter() at which the budget ends: the short commands run between parts
    (--help, the planner) stop there too."""
    helps: dict[str, str] = field(default_factory=dict)
    """--help text of each script, read once."""

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def run_short(self, command: list[str]) -> tuple[int | None, str, str]:
        """(exit status or None when it timed out, stdout, stderr) of a command between parts:
        forked from the dry run's torch-loaded forkserver (device_check_forks.py), else its own
        interpreter."""
        if self.dry_run:
            from device_check_forks import run_forked

            code, out, err, _, _ = run_forked(command[1:], ROOT, dict(os.environ), self.short_timeout(), stderr_apart=True)
            return code, out, err
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=self.short_timeout())
        except subprocess.TimeoutExpired:
            return None, "", ""
        return done.returncode, done.stdout, done.stderr

    def short_timeout(self) -> float:
        """Seconds for a command between parts: at most 60 (a loaded machine's dry run: more),
        never past the deadline."""
        return max(1.0, min(DRY_RUN_TIMEOUT_S if self.dry_run else 60.0, self.deadline - time.perf_counter()))


@dataclass
class Step:
    """A part's decision: run `command` for at most `timeout_s`, or record `skip` and run nothing."""
    command: list[str] = field(default_factory=list)
    timeout_s: float = 0.0
    skip: str = ""


@dataclass
class Part:
    name: str
    section: int
    """The issue's numbering: 1 tests, 2 training, 3 generation and serving, 4 kernels, 5 memory."""
    title: str
    step: Callable[[Context], Step]
    read: Callable[[str], dict]
    """Output text -> figures (empty when none were found)."""
    planner: Callable[[Context], dict] | None = None
    """The planner's prediction for this run, or None where the planner models nothing of it."""


def _number(text: str) -> float:
    return float(text.replace(",", ""))


# 1. The CUDA-marked tests.

def cuda_test_files() -> list[str]:
    """The test files that mark tests `cuda` (tests/test_cuda_*.py and any other). Collecting
    only these keeps the part short and keeps modules out that import a test-only package a GPU
    node may lack (test_match.py's pyahocorasick): their import error is no CUDA finding."""
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                  if re.search(r"mark\.cuda\b|CUDA_ONLY", path.read_text(errors="replace")))


def tests_step(ctx: Context) -> Step:
    # -v: a line per test as it ends, so a part stopped by its timeout still says which passed;
    # --timeout (pytest-timeout): a hung test (a collective that never returns) fails alone.
    return Step(ctx.python("-m", "pytest", "-m", "cuda", "-v", "-rfEs", "-p", "no:cacheprovider", "--timeout=120",
                           "--continue-on-collection-errors", *cuda_test_files()),
                DRY_RUN_TIMEOUT_S if ctx.dry_run else 200)


def read_tests(text: str) -> dict:
    """pytest's final counts; without them (stopped early), the per-test lines of -v."""
    summary = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s", text, re.M)
    per_test = re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", text, re.M)
    if summary:
        counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary[-1][0])}
    elif per_test:
        counts = {}
        for _, outcome in per_test:
            counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    else:
        return {}
    figures = {key: counts.get(key, 0) for key in ("passed", "failed", "skipped", "error", "errors", "deselected")}
    figures["errors"] = figures.pop("error") + figures["errors"]
    figures["not_passed"] = sorted({name for name, outcome in per_test if outcome in ("FAILED", "ERROR")}
                                   | set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)))
    if not summary:
        figures["incomplete"] = True
    return figures


# 2. Training throughput and MFU of one device.

TRAIN_SCRIPT = "benchmarks/single_device_throughput.py"
TRAIN_VARIANTS = {"bf16": ((), "eager"), "bf16_compile": (("--compile",), "compile"),
                  "bf16_compile_float8": (("--compile", "--float8"), "float8"), "bf16_float8": (("--float8",), "float8")}
"""Part name -> (the script's flags, the arm of its output the row reports). A script that
trains several arms in one run (eager, then compile, then float8) prints a line per arm and
their ratios, measured in the same process: each row keeps them all."""


def train_sizes(ctx: Context) -> dict:
    """The benchmark's model and batch for this mode: (size name, steps, global batch, seq)."""
    return dict(size="tiny", steps=6, global_batch=4, seq_len=64) if ctx.dry_run else \
        dict(size="1b", steps=20, global_batch=8, seq_len=2048)


def train_step(flags: tuple[str, ...]) -> Callable[[Context], Step]:
    def step(ctx: Context) -> Step:
        missing = [flag for flag in flags if flag not in help_text(ctx, TRAIN_SCRIPT)]
        if missing:
            return Step(skip=f"{NOT_IN_BUILD} ({TRAIN_SCRIPT} has no {' '.join(missing)})")
        if flags and ctx.dry_run:
            return Step(skip="dry run: the eager variant only (compiling and float8 on a CPU take minutes)")
        sizes = train_sizes(ctx)
        args = ["--size", sizes["size"], "--steps", str(sizes["steps"]), "--global-batch", str(sizes["global_batch"]),
                "--seq-len", str(sizes["seq_len"])]
        # Bounds, not measurements (no GPU has run this yet): an eager arm draws the 1B model's
        # weights and takes 20 steps of ~0.1 PFLOP, expected well under a minute on an H100-class
        # GPU; each compiled arm adds its compilation.
        timeout = DRY_RUN_TIMEOUT_S if ctx.dry_run else {0: 90, 1: 200, 2: 300}[len(flags)]
        return Step(ctx.python(TRAIN_SCRIPT, *args, *flags), timeout)
    return step


_ARM = (r"^\s+(\w+)\s+([\d,]+) tokens/s\s+([\d.]+) model TFLOP/s\s+peak memory ([\d,]+) MB"
        r"(?:\s+MFU ([\d.]+)% of ([\d.]+) TFLOP/s)?"
        r"(?:\s+energy ([\d,.]+) J/step, ([\d.e+-]+) J/token \(([\d,]+) W\))?")
"""An arm's line; on CUDA with NVML's counter it ends with the energy the GPU drew."""
_ONE_ARM = r"median ([\d,]+) tokens/s, ([\d.]+) model TFLOP/s, peak memory ([\d,]+) MB"


def read_train_arm(arm: str) -> Callable[[str], dict]:
    """Reader of the training script's output, reporting `arm` (its figures at the top)."""
    def read(text: str) -> dict:
        head = re.search(r"(\S+): (\d+) x (\d+) tokens per step", text)
        if not head:
            return {}
        arms = {}
        for name, rate, tflops, memory, mfu, peak, joules, per_token, watts in re.findall(_ARM, text, re.M):
            arms[name] = {"tokens_per_s": _number(rate), "model_tflops": float(tflops), "peak_mem_mb": _number(memory)}
            if mfu:
                arms[name].update(mfu=float(mfu) / 100, peak_tflops=float(peak))
            if joules:
                arms[name].update(energy_j_per_step=_number(joules), energy_j_per_token=float(per_token),
                                  watts=_number(watts))
        for name, why in re.findall(r"^\s+(\w+): energy not measured: (.*)$", text, re.M):
            if name in arms:
                arms[name]["energy_note"] = why.strip()
        if one := re.search(_ONE_ARM, text):  # one arm on the header line (before --compile existed)
            arms["eager"] = {"tokens_per_s": _number(one[1]), "model_tflops": float(one[2]),
                             "peak_mem_mb": _number(one[3])}
            if mfu := re.search(r"MFU = ([\d.]+)% of ([\d.]+) TFLOP/s", text):
                arms["eager"].update(mfu=float(mfu[1]) / 100, peak_tflops=float(mfu[2]))
        if not arms:
            return {}
        # The row's own arm at the top; without it (a run that failed at its last arm) the
        # arms before it still count.
        figures = {"model": head[1], "global_batch": int(head[2]), "seq_len": int(head[3]), "arm": arm,
                   **arms.get(arm, {}), "arms": arms,
                   "ratios": {f"{a} / {b}": float(r) for a, b, r in re.findall(r"^(\w+) / (\w+)\s+= ([\d.]+)x", text, re.M)}}
        if nccl := re.search(r"NCCL all_reduce on 1 rank: (.*)", text):
            figures["nccl_all_reduce"] = nccl[1].strip()
        return figures
    return read


def train_planner(ctx: Context) -> dict:
    """`phalanx plan --json` for the benchmark's own model, batch and layout (one device, no
    recompute, no ZeRO) on this device's cluster: step time, tokens/s, MFU, memory, and the
    energy per step and per token (planner/energy.py; None where the cluster has no power
    figures, as `local` has none)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from single_device_throughput import SIZES  # noqa: E402  (the benchmark's models)

    sizes = train_sizes(ctx)
    model = SIZES[sizes["size"]]
    defaults = type(model)()
    spec = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
            if getattr(model, f.name) != getattr(defaults, f.name)
            or f.name in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")}
    path = ctx.workdir / f"{model.name}.json"  # beside the results
    path.write_text(json.dumps(spec))
    batch = sizes["global_batch"]
    command = ["-m", "phalanx", "plan", "--model", str(path), "--cluster", ctx.cluster, "--gpus", "1",
               "--global-batch", str(batch), "--seq-len", str(sizes["seq_len"]), "--json", "--top", "1",
               "--dtype", "fp32" if ctx.dry_run else "bf16",
               "--fix", f"dp=1,tp=1,pp=1,mbs={batch},recompute=none,zero=0"]
    code, stdout, stderr = ctx.run_short(ctx.python(*command))
    if code != 0 or not stdout.strip():
        return {"error": (stderr.strip().splitlines() or ["no output" if code is not None else "timed out"])[-1],
                "command": _shown(command)}
    best = json.loads(stdout)["plans"][0]
    return {"cluster": ctx.cluster, "tokens_per_s": best["tokens_per_s"], "mfu": best["mfu"],
            "step_time_s": best["step_time_s"], "step_time_band": best["step_time_band"],
            "memory_gib": best["memory_gib_per_gpu"], "energy_j_per_step": best.get("energy_j_per_step"),
            "energy_j_per_token": best.get("energy_j_per_token"), "command": _shown(command)}


# 3. Generation against transformers.generate, and serving.

def generate_step(ctx: Context) -> Step:
    if ctx.dry_run:
        sizes = ["--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256", "--prompt", "16", "--new", "8",
                 "--repeats", "1"]
    else:  # a 0.14B llama shape: large enough that the GPU, not Python, sets prefill's pace
        sizes = ["--hidden", "1024", "--layers", "8", "--heads", "16", "--vocab", "8192", "--prompt", "512", "--new",
                 "128", "--repeats", "3"]
    return Step(ctx.python("benchmarks/generate_throughput.py", "--device", "cpu" if ctx.dry_run else "cuda", *sizes),
                DRY_RUN_TIMEOUT_S if ctx.dry_run else 90)


def read_generate(text: str) -> dict:
    figures = {}
    for phase, arm, median, best in re.findall(r"(prefill|decode)\s+(phalanx|transformers)\s+median\s+([\d,]+) tokens/s"
                                               r"\s+best\s+([\d,]+) tokens/s", text):
        figures[f"{phase}_{arm}_tokens_per_s"] = _number(median)
        figures[f"{phase}_{arm}_best_tokens_per_s"] = _number(best)
    for phase, median, best in re.findall(r"(prefill|decode) ratio phalanx / transformers = ([\d.]+) \(median\), "
                                          r"([\d.]+) \(best\)", text):
        figures[f"{phase}_ratio"] = float(median)
        figures[f"{phase}_ratio_best"] = float(best)
    if same := re.search(r"same tokens: (yes|NO)", text):
        figures["same_tokens"] = same[1] == "yes"
    return figures


SERVE_SCRIPT = "benchmarks/serve_load.py"


def serve_step(ctx: Context) -> Step:
    if not (ROOT / SERVE_SCRIPT).exists():
        return Step(skip=f"{NOT_IN_BUILD} (no {SERVE_SCRIPT})")
    if "--device" not in help_text(ctx, SERVE_SCRIPT):
        return Step(skip=f"{NOT_IN_BUILD} ({SERVE_SCRIPT} has no --device)")
    quick = ["--quick"] if ctx.dry_run and "--quick" in help_text(ctx, SERVE_SCRIPT) else []
    return Step(ctx.python(SERVE_SCRIPT, "--device", "cpu" if ctx.dry_run else "cuda", *quick), DRY_RUN_TIMEOUT_S if ctx.dry_run else 90)


SERVE_ROW = re.compile(r"^(phalanx serve, .+?|\([abc]\) .+?)\s{2,}([\d.]+)((?:\s+(?:[\d.]+|-)){5})\s*$", re.M)
SERVE_COLUMNS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "goodput_req_per_s")


def read_serve(text: str) -> dict:
    """serve_load.py's table (one row per arm: output tokens/s, TTFT and TPOT p50/p99, goodput)
    and its closed loop's throughput against (a), (b) and (c)."""
    arms = {}
    for name, rate, rest in SERVE_ROW.findall(text):
        row = {"tokens_per_s": float(rate)}
        row.update({key: float(value) for key, value in zip(SERVE_COLUMNS, rest.split()) if value != "-"})
        arms[name] = row
    ratios = {arm: float(ratio) for arm, ratio in
              re.findall(r"^phalanx closed loop / \(([abc])\): throughput ([\d.]+)x", text, re.M)}
    return {"arms": arms, "ratios": ratios} if arms else {}


# 4. Matching and blur against serial Wu-Manber and scipy.

def match_step(ctx: Context) -> Step:
    if ctx.dry_run:
        return Step(ctx.python("benchmarks/match_throughput.py", "--device", "cpu", "--mb", "0.05", "--patterns", "100"),
                    DRY_RUN_TIMEOUT_S)
    # 1 MB texts; the best of 2 runs keeps CUDA's start out of phalanx's time (the serial
    # baseline, interpreted Python, is most of this part's minute).
    return Step(ctx.python("benchmarks/match_throughput.py", "--device", "cuda", "--quick", "--repeats", "2"), 150)


def read_match(text: str) -> dict:
    cases = []
    for block in re.split(r"\n(?=\S.*patterns, phalanx algorithm)", text):
        head = re.match(r"(.+), (\d+) patterns, phalanx algorithm (\S+):", block)
        ours = re.search(r"^\s+phalanx\s+([\d.]+) s\s+(\d+) matches", block, re.M)
        if not (head and ours):
            continue
        case = {"case": head[1], "patterns": int(head[2]), "algorithm": head[3], "phalanx_s": float(ours[1]),
                "matches": int(ours[2])}
        if kernel := re.search(r"phalanx kernel only \(GPU\)\s+([\d.]+) s", block):
            case["kernel_s"] = float(kernel[1])
        if serial := re.search(r"serial Wu-Manber \(Python\)\s+([\d.]+) s\s+ratio\s+([\d.]+)", block):
            case["serial_s"], case["serial_ratio"] = float(serial[1]), float(serial[2])
            if case.get("kernel_s"):
                case["serial_ratio_kernel"] = case["serial_s"] / case["kernel_s"]
        case["counts_agree"] = "COUNT DIFFERS" not in block
        cases.append(case)
    if not cases:
        return {}
    wu_manber = [c for c in cases if c["algorithm"] == "wu-manber" and "serial_ratio" in c]
    figures: dict = {"cases": cases}
    if wu_manber:  # the seeds' claim: >= 10x the serial Wu-Manber
        figures["min_serial_ratio_wu_manber"] = min(c["serial_ratio"] for c in wu_manber)
        figures["claim_10x_serial_met"] = figures["min_serial_ratio_wu_manber"] >= 10
    return figures


def blur_step(ctx: Context) -> Step:
    size, device = ("128", "cpu") if ctx.dry_run else ("4096", "cuda")
    return Step(ctx.python("benchmarks/blur_tiles.py", "--device", device, "--size", size, "--nproc", "1"),
                DRY_RUN_TIMEOUT_S if ctx.dry_run else 60)


def read_blur(text: str) -> dict:
    scipy = re.search(r"scipy gaussian_filter\s+([\d.]+) s", text)
    ours = re.search(r"phalanx, 1 process\s+([\d.]+) s\s+ratio scipy/phalanx\s+([\d.]+)\s+max \|diff\| (\S+)", text)
    if not (scipy and ours):
        return {}
    figures = {"scipy_s": float(scipy[1]), "phalanx_s": float(ours[1]), "scipy_ratio": float(ours[2]),
               "max_diff": float(ours[3])}
    if kernel := re.search(r"phalanx kernel only \(GPU\)\s+([\d.]+) s", text):
        figures["kernel_s"] = float(kernel[1])
        figures["scipy_ratio_kernel"] = figures["scipy_s"] / max(figures["kernel_s"], 1e-9)
    return figures


def attention_step(ctx: Context) -> Step:
    if ctx.dry_run:
        return Step(ctx.python("benchmarks/attention_efficiency.py", "--device", "cpu", "--quick"), DRY_RUN_TIMEOUT_S)
    return Step(ctx.python("benchmarks/attention_efficiency.py", "--device", "cuda", "--cluster", ctx.cluster), 120)


def read_attention(text: str) -> dict:
    attention = re.search(r"^attention efficiency \((?:slope|seq) [^)]*\): ([\d.]+); the planner's: ([\d.]+)", text, re.M)
    matmul = re.search(r"^matmul efficiency \(\d+\^3\): ([\d.]+); the planner's: ([\d.]+)", text, re.M)
    if not (attention and matmul):
        return {}
    points = [{"seq": int(seq), "of_peak": float(frac)} for seq, frac in
              re.findall(r"^causal attention seq\s+(\d+): .*?, ([\d.]+) of peak", text, re.M)]
    return {"attention_efficiency": float(attention[1]), "planner_attention_efficiency": float(attention[2]),
            "matmul_efficiency": float(matmul[1]), "planner_matmul_efficiency": float(matmul[2]),
            "attention_by_seq": points}


# 5. The planner's memory model against the allocator.

def memory_step(ctx: Context) -> Step:
    if ctx.dry_run:
        return Step(ctx.python("benchmarks/planner_memory.py", "--device", "cpu", "--only", "small microbatches=1",
                               "--model", "tiny"), DRY_RUN_TIMEOUT_S)
    return Step(ctx.python("benchmarks/planner_memory.py", "--device", "cuda"), 90)


def read_memory(text: str) -> dict:
    rows = []
    for half, world, model, plan, cells in re.findall(r"^(decide|hold-out)\s+(\d+)\s+(\S+)\s+(\S+)\s+(.*?)\s+\[\d+ s\]$",
                                                     text, re.M):
        row = {"half": half, "processes": int(world), "model": model, "plan": plan}
        for key, predicted, measured, error in re.findall(r"(\w+) ([\d.]+)/([\d.]+) \(([+-]\d+)%\)", cells):
            row[key] = {"predicted_mib": float(predicted), "measured_mib": float(measured), "error": int(error) / 100}
        if allocator := re.search(r"allocator ([\d.]+)", cells):
            row["allocator_mib"] = float(allocator[1])
        rows.append(row)
    return {"rows": rows} if rows else {}


PARTS = [
    Part("cuda_tests", 1, "CUDA-marked tests (pytest -m cuda)", tests_step, read_tests),
    *(Part(f"train_{name}", 2, f"training, {name.replace('_', ' + ')}", train_step(flags), read_train_arm(arm),
           train_planner) for name, (flags, arm) in TRAIN_VARIANTS.items()),
    Part("generate", 3, "generation vs transformers.generate", generate_step, read_generate),
    Part("serve", 3, "serving (serve_load.py)", serve_step, read_serve),
    Part("match", 4, "match vs serial Wu-Manber", match_step, read_match),
    Part("blur", 4, "blur vs scipy", blur_step, read_blur),
    Part("attention", 4, "attention and matmul efficiency vs the planner's", attention_step, read_attention),
    Part("planner_memory", 5, "planner memory model vs measured", memory_step, read_memory),
]
RUN_ORDER = ["cuda_tests", "attention", "train_bf16", "generate", "match", "blur", "planner_memory", "serve",
             "train_bf16_compile_float8", "train_bf16_compile", "train_bf16_float8"]
"""Cheap and sure parts first, the compiling ones last: when one of those runs long, the
budget it takes is the only one left. Of those, compile + float8 first: the script trains
eager, compiled and compiled float8 arms in that one run, with their ratios."""


def help_text(ctx: Context, script: str) -> str:
    """`script --help`, read once per run ("" when it fails)."""
    if script not in ctx.helps:
        code, stdout, _ = ctx.run_short(ctx.python(script, "--help"))
        ctx.helps[script] = stdout if code == 0 else ""
    return ctx.helps[script]


def _shown(command: list[str]) -> str:
    import shlex

    return shlex.join(["python", *command])
