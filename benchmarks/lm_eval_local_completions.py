"""lm-evaluation-harness against `phalanx serve`: its `local-completions` model (how people
evaluate a served model) scores what its `hf` model scores on the same checkpoint.

Two small local tasks over a random tiny llama with a word-level tokenizer (written here, so
nothing is downloaded): a multiple-choice task ranked by log-likelihood (lm-eval sends `echo:
true, logprobs: 1, max_tokens: 1` with a batch of token-id prompts, `--batch_size 4`), and a
generate_until task (greedy, stopped by a word). Prints each task's metric under both models,
the largest difference between their per-choice log-likelihoods (the baseline is lm-eval's own
`hf` model in the same run), how many greedy answers are the same, and the time each took.

    .venv/bin/python benchmarks/lm_eval_local_completions.py --lm-eval /path/to/venv/bin/lm_eval

lm-eval is a reference, not a phalanx dependency (the test extra has it, for
tests/test_lm_eval_harness.py, which checks the served side against `transformers` directly);
its `hf` model also needs accelerate: a venv of its own keeps that apart (`python3 -m venv v &&
v/bin/pip install torch==2.13.0 lm-eval==0.4.13 transformers accelerate aiohttp tenacity`).
The model and tasks are tests/lm_eval_tasks.py's.
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.lm_eval_tasks import write_model, write_tasks  # noqa: E402 (the path above first)

NAME = "tiny"


def run_lm_eval(lm_eval: str, model: str, model_args: str, tasks: Path, out: Path) -> float:
    began = time.monotonic()
    command = [lm_eval, "run", "--model", model, "--model_args", model_args, "--tasks", "phalanx_mc", "phalanx_gen",
               "--include_path", str(tasks), "--batch_size", "4", "--device", "cpu", "--log_samples", "--output_path", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"lm-eval --model {model} failed:\n{done.stderr[-4000:]}")
    return time.monotonic() - began


def read_run(out: Path) -> tuple[dict, dict]:
    """(metrics by task, per-document responses by task) from an lm-eval output directory."""
    results = json.loads(Path(sorted(glob.glob(f"{out}/**/results_*.json", recursive=True))[-1]).read_text())
    metrics = {task: {k: v for k, v in values.items() if isinstance(v, float)} for task, values in results["results"].items()}
    samples = {}
    for task in ("phalanx_mc", "phalanx_gen"):
        path = sorted(glob.glob(f"{out}/**/samples_{task}_*.jsonl", recursive=True))[-1]
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        samples[task] = {row["doc_id"]: row["resps"] for row in rows}
    return metrics, samples


def explain(model: Path, question: str, hf_answer, served_answer) -> None:
    """Where a generate_until answer differs: the two answers, and transformers' own greedy
    continuation of the question run alone (no batch, no padding) with the gap between its two
    most likely logits at each step, so a near tie (fp32 sums in another order) shows as one."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(question)["input_ids"]])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    gaps = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in out.logits]
    alone = tokenizer.decode(out.sequences[0, ids.shape[1]:])
    print(f"differs: {question!r}: hf (batched) {hf_answer}, served {served_answer}; transformers alone {alone!r}, "
          f"top-2 logit gaps {', '.join(f'{g:.1e}' for g in gaps)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", required=True, help="the lm_eval executable (in a venv of its own)")
    parser.add_argument("--docs", type=int, default=40, help="documents per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="also write the figures to this file")
    args = parser.parse_args()
    from tests.serve_server import ServeProcess

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = write_model(tmp / "model")
        (tmp / "tasks").mkdir()
        write_tasks(tmp / "tasks", args.docs, args.seed)
        hf_s = run_lm_eval(args.lm_eval, "hf", f"pretrained={model},dtype=float32", tmp / "tasks", tmp / "hf")
        server = ServeProcess(model, "--served-model-name", NAME)
        try:
            served_s = run_lm_eval(args.lm_eval, "local-completions",
                                   f"model={NAME},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                                   f"tokenizer={model},num_concurrent=1,max_retries=1,tokenized_requests=True",
                                   tmp / "tasks", tmp / "served")
        finally:
            server.stop()
        hf_metrics, hf_samples = read_run(tmp / "hf")
        served_metrics, served_samples = read_run(tmp / "served")
        questions = [json.loads(line)["question"] for line in (tmp / "tasks" / "gen.jsonl").read_text().splitlines()]
        differing = [doc for doc in hf_samples["phalanx_gen"]
                     if hf_samples["phalanx_gen"][doc] != served_samples["phalanx_gen"].get(doc)]
        for doc in differing:
            explain(model, questions[doc], hf_samples["phalanx_gen"][doc], served_samples["phalanx_gen"].get(doc))
    # multiple choice: resps[i] = [[loglikelihood, is_greedy]] per choice
    differences = [abs(float(a[0][0]) - float(b[0][0]))
                   for doc, resps in hf_samples["phalanx_mc"].items()
                   for a, b in zip(resps, served_samples["phalanx_mc"][doc])]
    same_answers = sum(hf_samples["phalanx_gen"][doc] == served_samples["phalanx_gen"].get(doc)
                       for doc in hf_samples["phalanx_gen"])
    figures = {"hf": hf_metrics, "phalanx_local_completions": served_metrics,
               "choice_loglikelihood_max_abs_difference": max(differences), "choices_compared": len(differences),
               "generate_until_same_answers": same_answers, "generate_until_docs": len(hf_samples["phalanx_gen"]),
               "hf_seconds": round(hf_s, 1), "served_seconds": round(served_s, 1)}
    for task in ("phalanx_mc", "phalanx_gen"):
        print(f"{task}: hf {hf_metrics[task]}  phalanx serve {served_metrics[task]}")
    print(f"choice log-likelihoods: largest |hf - served| {max(differences):.2e} over {len(differences)} choices")
    print(f"generate_until: {same_answers} of {len(hf_samples['phalanx_gen'])} answers the same")
    print(f"time: hf {hf_s:.1f} s, local-completions against phalanx serve {served_s:.1f} s (lm-eval start-up included)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
