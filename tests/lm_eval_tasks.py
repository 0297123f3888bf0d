"""A tiny llama with a word-level tokenizer that `transformers` loads, and two small local
lm-evaluation-harness tasks over it (multiple choice ranked by log-likelihood; generate_until,
greedy, stopped by the word w1, which is also the tokenizer's end-of-text token): what
tests/test_lm_eval_harness.py and benchmarks/lm_eval_local_completions.py run lm-eval on."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.hf_models import write_checkpoint

VOCAB = 64
MC_TASK = """task: phalanx_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: phalanx_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["w1"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def write_model(folder: Path) -> Path:
    """A random tiny llama and a word-level tokenizer (words w0 .. w63) that transformers loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    write_checkpoint(folder, "llama", vocab_size=VOCAB)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", unk_token="w0").save_pretrained(folder)
    return folder


def write_tasks(folder: Path, docs: int, seed: int) -> None:
    rng = random.Random(seed)
    words = lambda count: " ".join(f"w{rng.randrange(2, VOCAB)}" for _ in range(count))  # noqa: E731
    with open(folder / "mc.jsonl", "w") as mc, open(folder / "gen.jsonl", "w") as gen:
        for _ in range(docs):
            mc.write(json.dumps({"question": words(rng.randint(3, 12)), "choices": [words(rng.randint(1, 3)) for _ in range(4)],
                                 "answer": rng.randrange(4)}) + "\n")
            gen.write(json.dumps({"question": words(rng.randint(3, 12)), "answer": words(2)}) + "\n")
    (folder / "phalanx_mc.yaml").write_text(MC_TASK.format(data=folder / "mc.jsonl"))
    (folder / "phalanx_gen.yaml").write_text(GEN_TASK.format(data=folder / "gen.jsonl"))
