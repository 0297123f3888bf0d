"""Predicted vs published serving throughput: `phalanx plan --serve` against published runs.

The rows (phalanx/planner/serve_validation.json, each with its source) are the measured runs
of shared/reference/published-figures.md section 5 and more rows of the same TensorRT-LLM
table (perf-overview v1.0). Each row is evaluated at the layout, precision, lengths and load
its source states (`--fix`; all requests queued at once is a closed loop of that many
requests); nothing is fitted per row. Rows are split into a 'visible' half, the only one any
modelling choice may look at, and a 'holdout' half kept out of every decision; the median
|error| of each is printed (target: 15%).

    PYTHONPATH=. .venv/bin/python benchmarks/serve_planner_published.py [--kv-dtype bf16|fp8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from phalanx.model.config import PRESETS as MODELS
from phalanx.planner.hardware import PRESETS as CLUSTERS
from phalanx.planner.model_spec import model_from_dict
from phalanx.planner.serve_rates import ServeLoad
from phalanx.planner.serve_search import parse_serve_fix, search_serving

ROWS = Path(__file__).resolve().parents[1] / "phalanx" / "planner" / "serve_validation.json"


def predict(row: dict, models: dict, kv_dtype: str) -> float:
    model = MODELS.get(row["model"]) or model_from_dict(models[row["model"]], source=row["model"])
    load = ServeLoad(isl=row["isl"], osl=row["osl"], concurrency=row.get("concurrency"), phase=row["phase"])
    result = search_serving(model, CLUSTERS[row["cluster"]], load, gpus=row["gpus"], fixed=parse_serve_fix(row["fix"]),
                            weight_dtype=row["weight_dtype"], kv_dtype=row.get("kv_dtype", kv_dtype), keep=1)
    if not result.ranked:
        return float("nan")
    rates = result.ranked[0].rates
    return {"output_tokens_per_s_total": rates.output_tps_gpu * row["gpus"],
            "output_tokens_per_s_per_gpu": rates.output_tps_gpu,
            "input_tokens_per_s_per_gpu": rates.input_tps_gpu}[row["metric"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-dtype", default="fp8", choices=("bf16", "fp8"),
                        help="KV cache dtype of rows that do not state one (default fp8, chosen on the visible half)")
    args = parser.parse_args()
    data = json.loads(ROWS.read_text())
    start = time.perf_counter()
    errors: dict[str, list[float]] = {"visible": [], "holdout": []}
    print(f"{'row':>4} {'split':>8}  {'what':<44} {'isl/osl':>11} {'predicted':>10} {'published':>10} {'pred/pub':>8}")
    for row in data["rows"]:
        got = predict(row, data["models"], args.kv_dtype)
        ratio = got / row["measured"]
        errors[row["split"]].append(abs(ratio - 1))
        print(f"{row['id']:>4} {row['split']:>8}  {row['what'][:44]:<44} {row['isl']:>5}/{row['osl']:<5} "
              f"{got:>10,.0f} {row['measured']:>10,.0f} {ratio:>8.2f}")
    for split, errs in errors.items():
        print(f"{split}: {len(errs)} rows, median |error| {statistics.median(errs):.1%} (target 15%), "
              f"within 15%: {sum(e <= 0.15 for e in errs)}")
    print(f"({time.perf_counter() - start:.2f} s; KV dtype where a row states none: {args.kv_dtype})")


if __name__ == "__main__":
    main()
