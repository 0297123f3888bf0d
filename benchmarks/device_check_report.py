"""The Markdown of a device check (device_check.py's JSON as one table, ready to paste into
benchmarks/README.md): one row per part, in the issue's order, with the measurement and the
planner's prediction side by side, then the exact command of every part."""

from __future__ import annotations

from device_check_parts import PARTS


def _rate(value: float) -> str:
    return f"{value:,.0f}"


def _tests(f: dict) -> str:
    text = f"{f['passed']} passed, {f['failed']} failed, {f['errors']} errors, {f['skipped']} skipped"
    return text + (f"; not passed: {', '.join(f['not_passed'])}" if f["not_passed"] else "")


def _energy(joules: float, per_token: float) -> str:
    return f"{joules:,.1f} J/step, {per_token:.3g} J/token"


def _arm(name: str, a: dict) -> str:
    text = f"{name} {_rate(a['tokens_per_s'])} tokens/s, {a['model_tflops']:.1f} TFLOP/s"
    if "mfu" in a:
        text += f", MFU {a['mfu']:.1%} of {a['peak_tflops']:g}"
    text += f", peak {_rate(a['peak_mem_mb'])} MB"
    if "energy_j_per_step" in a:  # NVML's counter over the measured steps
        text += f", {_energy(a['energy_j_per_step'], a['energy_j_per_token'])} ({a['watts']:,.0f} W)"
    elif "energy_note" in a:
        text += f", energy not measured: {a['energy_note']}"
    return text


def _train(f: dict) -> str:
    """The row's own arm first, then the others of the same run and the script's ratios."""
    arms = f["arms"]
    order = sorted(arms, key=lambda name: name != f["arm"])
    text = f"{f['global_batch']} x {f['seq_len']}: " + "; ".join(_arm(name, arms[name]) for name in order)
    if f["arm"] not in arms:
        text += f"; no {f['arm']} arm"
    if f["ratios"]:
        text += "; " + ", ".join(f"{key} = {value:.2f}x" for key, value in f["ratios"].items())
    return text


def _train_planner(measured: dict, p: dict) -> str:
    if "error" in p:
        return f"planner failed: {p['error']}"
    text = f"{_rate(p['tokens_per_s'])} tokens/s (±{p['step_time_band']:.0%})"
    if measured.get("tokens_per_s"):
        text += f", predicted/measured {p['tokens_per_s'] / measured['tokens_per_s']:.2f}"
    text += f", MFU {p['mfu']:.1%}, {p['memory_gib']:.3g} GiB"
    if measured.get("peak_mem_mb"):
        text += f" (measured peak {measured['peak_mem_mb'] / 1024:.3g} GiB)"
    if p.get("energy_j_per_step") is not None:  # at the predicted step time (planner/energy.py)
        text += f", {_energy(p['energy_j_per_step'], p['energy_j_per_token'])} ({p['energy_j_per_step'] / p['step_time_s']:,.0f} W)"
        if measured.get("energy_j_per_step"):
            text += f", energy predicted/measured {p['energy_j_per_step'] / measured['energy_j_per_step']:.2f}"
    elif "energy_j_per_step" in p:
        text += ", no energy (the cluster has no power figures)"
    return text + f" on {p['cluster']}"


def _generate(f: dict) -> str:
    parts = []
    for phase in ("prefill", "decode"):
        if f"{phase}_phalanx_tokens_per_s" in f:
            parts.append(f"{phase} {_rate(f[f'{phase}_phalanx_tokens_per_s'])} vs "
                         f"{_rate(f[f'{phase}_transformers_tokens_per_s'])} tokens/s ({f[f'{phase}_ratio']:.2f}x)")
    return "; ".join(parts) + ("" if f.get("same_tokens", True) else "; TOKENS DIFFER")


def _match(f: dict) -> str:
    cells = []
    for c in f["cases"]:
        cell = f"{c['case']}/{c['patterns']}: {c['phalanx_s']:.3f} s"
        if "kernel_s" in c:
            cell += f" (kernel {c['kernel_s']:.3f} s)"
        if "serial_ratio" in c:
            cell += f", {c['serial_ratio']:.1f}x serial"
            if "serial_ratio_kernel" in c:
                cell += f" ({c['serial_ratio_kernel']:.1f}x kernel only)"
        cells.append(cell + ("" if c["counts_agree"] else " COUNTS DIFFER"))
    if "claim_10x_serial_met" in f:
        cells.append(f"claim >= 10x serial (Wu-Manber, end to end): {'met' if f['claim_10x_serial_met'] else 'NOT met'} "
                     f"(least {f['min_serial_ratio_wu_manber']:.1f}x)")
    return "; ".join(cells)


def _blur(f: dict) -> str:
    text = f"scipy {f['scipy_s']:.3f} s, phalanx {f['phalanx_s']:.3f} s ({f['scipy_ratio']:.2f}x scipy)"
    if "kernel_s" in f:
        text += f", kernel {f['kernel_s']:.3f} s ({f['scipy_ratio_kernel']:.1f}x scipy)"
    return text + f", max diff {f['max_diff']:.1e}"


def _memory(f: dict) -> str:
    cells = []
    for row in f["rows"]:
        total = row.get("total", {})
        cell = f"{row['model']} {row['plan']}: total {total.get('predicted_mib', 0):.1f}/{total.get('measured_mib', 0):.1f} MiB " \
               f"predicted/measured ({total.get('error', 0):+.0%})"
        if "allocator_mib" in row:
            cell += f", allocator peak {row['allocator_mib']:.1f} MiB"
        cells.append(cell)
    return "; ".join(cells)


def _serve(f: dict) -> str:
    cells = [f"{name} {row['tokens_per_s']:,.1f} tokens/s" + (f", TTFT p99 {row['ttft_p99']:.3f} s" if "ttft_p99" in row else "")
             for name, row in f["arms"].items() if name.startswith("phalanx")]
    ratios = ", ".join(f"{ratio:.2f}x ({arm})" for arm, ratio in f["ratios"].items())
    return "; ".join(cells) + (f"; closed loop {ratios}" if ratios else "")


def _attention(f: dict) -> str:
    return (f"attention {f['attention_efficiency']:.3f} of peak (planner {f['planner_attention_efficiency']:.2f}), "
            f"matmul {f['matmul_efficiency']:.3f} (planner {f['planner_matmul_efficiency']:.2f})")


MEASURED = {"cuda_tests": _tests, "generate": _generate, "serve": _serve, "match": _match, "blur": _blur,
            "attention": _attention, "planner_memory": _memory}


def _cpu(record: dict) -> str:
    """CPU seconds of the part's processes; known only when it ran alone (not with --jobs 2)."""
    return f"{record['cpu_s']:.0f}" if "cpu_s" in record else "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(result: dict) -> str:
    env = result["environment"]
    order = {p.name: i for i, p in enumerate(PARTS)}
    parts = sorted(result["parts"], key=lambda r: order[r["name"]])
    lines = [f"Device check on {env['device']}, torch {env['torch']} (CUDA {env['cuda']}), commit {env['commit']}, "
             f"{result['started']}, {result.get('wall_s', 0):.0f} s of a {result['budget_s']:.0f} s budget "
             f"(`benchmarks/device_check.sh{' --dry-run' if env['dry_run'] else ''}`):", "",
             "| # | part | status | s (CPU s) | measured | planner predicts |", "|---|---|---|---|---|---|"]
    for record in parts:
        figures = record.get("figures") or {}
        name = record["name"]
        summarize = _train if name.startswith("train_") else MEASURED[name]
        try:
            measured = summarize(figures) if figures else ""
        except KeyError as missing:  # a figure the summary needs was not printed
            measured = f"(figure {missing} not found)"
        except (TypeError, ValueError) as error:  # a figure of another kind than the summary expects
            measured = f"(figures unreadable: {error})"
        if record.get("output_tail") and record["status"] != "ok":
            measured = (measured + "; " if measured else "") + f"last line: {record['output_tail'][-1]}"
        planner = record.get("planner")
        predicted = _train_planner(figures, planner) if planner else "in the measured cell" if name == "planner_memory" else "-"
        lines.append(f"| {record['section']} | {_cell(record['title'])} | {_cell(record['status'])} | "
                     f"{record['seconds']:.0f} ({_cpu(record)}) | {_cell(measured)} | {_cell(predicted)} |")
    lines += ["", "Commands (from the repository root, PYTHONPATH=.):", ""]
    lines += [f"- {r['name']}: `{r['command']}`" for r in parts if r.get("command")]
    planner_commands = {r["planner"]["command"] for r in parts if isinstance(r.get("planner"), dict)
                        and r["planner"].get("command")}
    lines += [f"- planner: `{command}`" for command in sorted(planner_commands)]
    return "\n".join(lines) + "\n"
