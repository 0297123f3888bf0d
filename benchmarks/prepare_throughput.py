"""`phalanx prepare` MB/s against a plain `tokenizers` batch-encode loop on the same input.

Input: a JSONL file of the Python standard library's sources (one document per file,
repeated until --mb megabytes), built in a temporary folder; tokenizer: a byte-level BPE of
--vocab tokens trained on the first 4 MB of it (nothing can be downloaded here).

- baseline: what one writes by hand: read the JSONL, `json.loads` each line, call
  `Tokenizer.encode_batch` on batches of 1,000 non-empty texts (its Rust threads use every
  core), append the end-of-text id, and write uint16 ids to one file.
- phalanx: `phalanx.data.prepare.prepare` (what the CLI runs, without interpreter start):
  the same reading and encoding in --workers processes, plus the validation split, shards,
  progress accounting and the atomic rename.

The arms alternate (baseline, phalanx, phalanx, baseline, ...) and the fastest of --repeats
runs of each is compared; the ratio is phalanx MB/s over baseline MB/s (higher is better).

Reproduce:  .venv/bin/python benchmarks/prepare_throughput.py            (recorded, no target yet)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np


def build_input(folder: Path, megabytes: float) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(root.rglob("*.py")) if "test" not in p.parts][:3000]
    path, written, limit = folder / "corpus.jsonl", 0, megabytes * 1e6
    with path.open("w") as out:
        while written < limit:
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line.encode())
                if written >= limit:
                    break
    return path


def train_tokenizer(corpus: Path, path: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample, size = [], 0
    with corpus.open() as lines:
        for line in lines:
            sample.append(json.loads(line)["text"])
            size += len(line)
            if size > 4e6:
                break
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample, trainer)
    tok.save(str(path))
    return path


def baseline(corpus: Path, tokenizer: Path, out: Path) -> float:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    began = time.perf_counter()
    with corpus.open() as lines, out.open("wb") as sink:
        batch = []
        for line in lines:
            text = json.loads(line)["text"]
            if text:  # as prepare: an empty document adds nothing, not even an end-of-text token
                batch.append(text)
            if len(batch) == 1000:
                for enc in tok.encode_batch(batch, add_special_tokens=False):
                    np.array(enc.ids + [eos], dtype=np.uint16).tofile(sink)
                batch = []
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            np.array(enc.ids + [eos], dtype=np.uint16).tofile(sink)
    return time.perf_counter() - began


def phalanx_prepare(corpus: Path, tokenizer: Path, out: Path, workers: int) -> tuple[float, dict]:
    from phalanx.data.prepare import prepare

    shutil.rmtree(out, ignore_errors=True)
    began = time.perf_counter()
    manifest = prepare([str(corpus)], tokenizer=str(tokenizer), out=str(out), workers=workers, progress=False)
    return time.perf_counter() - began, manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8, help="input size in MB")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary of the test tokenizer")
    parser.add_argument("--workers", type=int, default=0, help="prepare's worker processes (default: the cores)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        corpus = build_input(folder, args.mb)
        megabytes = corpus.stat().st_size / 1e6
        tokenizer = train_tokenizer(corpus, folder / "tokenizer.json", args.vocab)
        base_times, prep_times = [], []
        for i in range(args.repeats):  # ABBA order: drift and noise hit both arms alike
            arms = ("base", "prep") if i % 2 == 0 else ("prep", "base")
            for arm in arms:
                if arm == "base":
                    base_times.append(baseline(corpus, tokenizer, folder / "baseline.bin"))
                else:
                    seconds, manifest = phalanx_prepare(corpus, tokenizer, folder / "prepared", args.workers)
                    prep_times.append(seconds)
        base_tokens = (folder / "baseline.bin").stat().st_size // 2
    assert base_tokens == manifest["tokens"], (base_tokens, manifest["tokens"])  # the same work was done
    base_mbs, prep_mbs = megabytes / min(base_times), megabytes / min(prep_times)
    print(f"input {megabytes:.1f} MB JSONL ({manifest['documents']:,} documents), byte-level BPE vocabulary {args.vocab}, "
          f"{cores} cores, fastest of {args.repeats}")
    print(f"  baseline (tokenizers encode_batch loop)   {min(base_times):6.2f} s  {base_mbs:6.2f} MB/s  {base_tokens:,} tokens")
    print(f"  phalanx prepare ({args.workers or cores} workers)              {min(prep_times):6.2f} s  {prep_mbs:6.2f} MB/s  "
          f"{manifest['tokens']:,} tokens")
    print(f"ratio phalanx / baseline = {prep_mbs / base_mbs:.2f}")


if __name__ == "__main__":
    main()
