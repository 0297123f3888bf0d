"""lm-evaluation-harness's `local-completions` model (how people evaluate a served model)
against a real `phalanx serve`, on a multiple-choice task ranked by log-likelihood (it sends
`echo: true, logprobs: 1, max_tokens: 1` with a batch of 4 token-id prompts, `batch_size 4`)
and a generate_until task: every choice's log-likelihood as lm-eval read it equals
`transformers`' log-softmax sum over the same tokens within 1e-4 (float32 forwards of the same
weights differ by about 1e-6; a rounding or an off-by-one position would be far larger), so
its accuracy is the reference's; every greedy answer equals `transformers`' greedy
continuation cut at the stop word, unless the reference's two best logits are within
serve_server.NEAR_TIE at a step before the cut.

`benchmarks/lm_eval_local_completions.py` runs the same tasks with lm-eval's own `hf` model
beside, as its users would compare, on more documents.
"""

from __future__ import annotations

import pytest
import torch

from lm_eval_tasks import write_model, write_tasks
from serve_server import NEAR_TIE, ServeProcess

DOCS = 8
NAME = "tiny"
TOLERANCE = 1e-4

lm_eval = pytest.importorskip("lm_eval")  # the test extra installs it: never skipped in CI


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """lm-eval's results with its samples, and the model directory."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval")
    model = write_model(folder / "model")
    (folder / "tasks").mkdir()
    write_tasks(folder / "tasks", DOCS, seed=0)
    server = ServeProcess(model, "--served-model-name", NAME)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=["phalanx_mc", "phalanx_gen"], batch_size=4, log_samples=True,
            model_args=f"model={NAME},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={model},num_concurrent=1,max_retries=1,tokenized_requests=True",
            task_manager=TaskManager(include_path=str(folder / "tasks")))
    finally:
        server.stop()
    return results, model


def _reference(model):
    import transformers

    return (transformers.AutoTokenizer.from_pretrained(model),
            transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval())


def test_every_choice_log_likelihood_equals_transformers(run):
    results, model = run
    tokenizer, reference = _reference(model)
    samples = results["samples"]["phalanx_mc"]
    assert len(samples) == DOCS
    right = 0
    for sample in samples:
        doc, scores = sample["doc"], [float(resp[0][0]) for resp in sample["resps"]]
        context = tokenizer(doc["question"])["input_ids"]
        expected = []
        for choice in doc["choices"]:
            continuation = tokenizer(" " + choice)["input_ids"]
            with torch.no_grad():
                logits = reference(torch.tensor([context + continuation])).logits[0].float()
            logprobs = torch.log_softmax(logits, -1)
            expected.append(sum(logprobs[len(context) + i - 1, token].item() for i, token in enumerate(continuation)))
        assert scores == pytest.approx(expected, abs=TOLERANCE)
        right += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    assert results["results"]["phalanx_mc"]["acc,none"] == pytest.approx(right / DOCS)


def test_every_greedy_answer_equals_transformers(run):
    results, model = run
    tokenizer, reference = _reference(model)
    end = tokenizer.convert_tokens_to_ids("w1")  # the task's stop word, and the tokenizer's end of text
    compared = 0
    for sample in results["samples"]["phalanx_gen"]:
        ids = torch.tensor([tokenizer(sample["doc"]["question"])["input_ids"]])
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                     output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        new = out.sequences[0, ids.shape[1]:].tolist()
        # The answer ends at the stop word as a string (OpenAI's and vLLM's `stop`: "w15" holds
        # "w1") or at the end-of-text token; compared up to the token where it ends.
        last = next((k for k in range(len(new)) if new[k] == end or "w1" in tokenizer.decode(new[:k + 1])), len(new) - 1)
        text = tokenizer.decode(new[:last + 1], skip_special_tokens=True).split("w1")[0]
        gaps = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in out.logits[:last + 1]]
        if min(gaps) < NEAR_TIE:
            continue
        compared += 1
        assert sample["resps"][0][0].strip() == text.strip(), sample["doc"]
    assert compared >= DOCS // 2, "too many near ties to compare: change the seed"
