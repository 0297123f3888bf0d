"""Every verb against one table of bad-input kinds: exit status 2, one line on stderr
(`phalanx: error: ...`) that names the flag or the path at fault, no traceback, no file left
behind, and the seconds each took (recorded as the test's `seconds` property, not asserted:
the machine is shared).

A verb joins by adding a `Verb` row to VERBS: a valid command (its file inputs and outputs as
<placeholders>), which of its flags and placeholders read files, write files, or take numbers.
The cases are every (verb, input, kind) the kinds below apply to. Verbs run in this process
through `phalanx.cli.main` (a subprocess would cost seconds of torch import per case).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from phalanx.cli import main
from phalanx.process_count import usable_cores

FILE_KINDS = ("missing", "directory", "binary", "truncated", "empty", "proc")
OUTPUT_KINDS = ("unwritable", "proc", "under_a_file")
NUMBER_KINDS = {"nan": "nan", "inf": "inf", "huge": "1e300", "negative": "-3"}
HUGE_INT = str(10**15)


@dataclass(frozen=True)
class Verb:
    argv: list[str]
    """A command that would run; <name> stands for a good input of GOOD_FILES or an output."""
    files: dict[str, str | tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    """Flag or <placeholder> -> the suffix of the file it reads, or (suffix, the FILE_KINDS that
    are bad for it: `match` reads any bytes, so binary or empty text is no error there)."""
    outputs: dict[str, str] = field(default_factory=dict)
    """Flag or <placeholder> -> "file" or "folder" it writes."""
    numbers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Flag -> the NUMBER_KINDS that are bad for it (an integer flag's huge is 10**15)."""
    contents: dict[str, dict[str, str]] = field(default_factory=dict)
    """Flag -> {kind: file text}: bad numbers inside a file it reads."""


TRAIN_BASE = ["train", "--model", "tiny", "--data", "<text>", "--steps", "1", "--global-batch", "2", "--seq-len", "16",
              "--no-progress", "--no-plot", "--sample-tokens", "0", "--eval-every", "0", "--device", "cpu", "--nproc", "1", "--out", "<out>"]
PLAN_BASE = ["--model", "<model>", "--cluster", "dgx-h100", "--global-batch", "64", "--seq-len", "1024"]
SERVE_PLAN_BASE = ["--model", "<model>", "--cluster", "dgx-h100", "--gpus", "8", "--isl", "128", "--osl", "64"]
BAD_NUMBERS = ("nan", "inf", "negative")
COUNTS = ("negative", "huge")

VERBS: dict[str, Verb] = {
    "train": Verb(TRAIN_BASE, files={"--config": (".toml", ("missing", "directory", "binary", "truncated", "proc")),
                                     "--data": (".txt", ("missing", "directory", "empty", "proc")),  # bytes train on anything
                                     "--model": ".json", "--tokenizer": ".json"},
                  outputs={"--out": "folder"},
                  numbers={"--lr": BAD_NUMBERS, "--steps": ("negative",), "--global-batch": COUNTS, "--seq-len": COUNTS,
                           "--nproc": COUNTS, "--collective-timeout": BAD_NUMBERS, "--max-bad-steps": ("negative",)}),
    "prepare": Verb(["prepare", "<jsonl>", "--tokenizer", "bytes", "--out", "<out>", "--no-progress", "--workers", "1"],
                    files={"<jsonl>": ".jsonl", "--tokenizer": ".json"}, outputs={"--out": "folder"},
                    numbers={"--val-fraction": (*BAD_NUMBERS, "huge"), "--workers": COUNTS}),
    "export": Verb(["export", "<run>", "<out>"], files={"<run>": ""}, outputs={"<out>": "folder"},
                   numbers={"--step": ("negative",)}),
    "generate": Verb(["generate", "--model", "<hf>", "--prompt-ids", "1,2", "--max-new-tokens", "2"],
                     files={"--model": "", "--tokenizer": ".json"},
                     numbers={"--max-new-tokens": COUNTS, "--temperature": BAD_NUMBERS,
                              "--top-p": (*BAD_NUMBERS, "huge"), "--top-k": ("negative",), "--nproc": COUNTS,
                              "--step": ("negative",)}),
    "plan": Verb(["plan", *PLAN_BASE, "--gpus", "8"], files={"--model": ".json", "--cluster": ".toml"},
                 numbers={"--gpus": COUNTS, "--global-batch": COUNTS, "--seq-len": COUNTS, "--top": ("negative",),
                          "--expert-slots": COUNTS}),
    "simulate": Verb(["simulate", *PLAN_BASE, "--plan", "tp=2", "--out", "<out>"],
                     files={"--model": ".json", "--cluster": ".toml"}, outputs={"--out": "folder"},
                     numbers={"--global-batch": COUNTS, "--seq-len": COUNTS, "--expert-slots": COUNTS}),
    "calibrate": Verb(["calibrate", "--quick", "--out", "<out.json>"], outputs={"--out": "file"},
                      numbers={"--max-procs": COUNTS}),
    "balance": Verb(["balance", "--load", "<load>", "--replicas", "8", "--gpus", "4"],
                    files={"--load": ".json", "--previous": ".json"}, outputs={"--plot": "file"},
                    numbers={"--replicas": COUNTS, "--gpus": COUNTS, "--groups": COUNTS, "--nodes": COUNTS,
                             "--window": ("negative",)},
                    contents={"--load": {"nan": "[[NaN, 1, 1, 1]]", "inf": "[[Infinity, 1, 1, 1]]",
                                         "negative": "[[-1, 2, 3, 4]]", "empty_table": "[]"}}),
    "match": Verb(["match", "--patterns", "<patterns>", "<text>"],
                  files={"--patterns": (".txt", ("missing", "directory", "empty")), "<text>": (".txt", ("missing", "directory"))},
                  numbers={"--nproc": COUNTS}),
    "serve": Verb(["serve", "--model", "<hf>", "--port", "0"],
                  numbers={"--port": COUNTS, "--max-num-seqs": COUNTS, "--max-num-batched-tokens": COUNTS,
                           "--num-kv-blocks": COUNTS, "--block-size": COUNTS, "--kv-cache-memory": BAD_NUMBERS,
                           "--ttft-ms": BAD_NUMBERS, "--tpot-ms": BAD_NUMBERS, "--nproc": COUNTS,
                           "--collective-timeout": BAD_NUMBERS, "--shutdown-grace": BAD_NUMBERS,
                           "--max-restarts": ("negative",), "--max-request-bytes": ("negative",)},
                  files={"--model": "", "--tokenizer": ".json", "--api-key-file": ("", ("missing", "directory", "empty",
                                                                                           "binary", "proc"))}),
    "plan --serve": Verb(["plan", "--serve", *SERVE_PLAN_BASE], files={"--model": ".json", "--cluster": ".toml"},
                         numbers={"--gpus": COUNTS, "--isl": COUNTS, "--osl": COUNTS, "--concurrency": COUNTS,
                                  "--rate": BAD_NUMBERS, "--ttft-ms": BAD_NUMBERS, "--tpot-ms": BAD_NUMBERS}),
    "simulate --serve": Verb(["simulate", "--serve", *SERVE_PLAN_BASE, "--rate", "2", "--out", "<out>"],
                             files={"--model": ".json", "--cluster": ".toml"}, outputs={"--out": "folder"},
                             numbers={"--gpus": COUNTS, "--isl": COUNTS, "--osl": COUNTS, "--rate": BAD_NUMBERS}),
    "blur": Verb(["blur", "<png>", "<out.png>", "--sigma", "1"], files={"<png>": ".png"}, outputs={"<out.png>": "file"},
                 numbers={"--sigma": (*BAD_NUMBERS, "huge"), "--tiles": ("negative",), "--nproc": COUNTS}),
}


def _png() -> bytes:
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray((np.arange(8 * 8 * 3) % 256).astype(np.uint8).reshape(8, 8, 3)).save(buffer, format="PNG")
    return buffer.getvalue()


GOOD_TEXT = {
    ".toml": 'steps = 1\nseq_len = 16\n',
    ".txt": "hello phalanx. " * 40,
    ".jsonl": '{"text": "hello phalanx"}\n' * 20,
    ".json": json.dumps({"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 128, "vocab_size": 256}),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, str]:
    """The good inputs every row's valid command uses."""
    import phalanx.hf as hf
    from phalanx.model.by_name import model_config
    from phalanx.model.init import build_model, init_weights

    folder = tmp_path_factory.mktemp("good")
    (folder / "text.txt").write_text(GOOD_TEXT[".txt"])
    (folder / "data.jsonl").write_text(GOOD_TEXT[".jsonl"])
    (folder / "model.json").write_text(GOOD_TEXT[".json"])
    (folder / "load.json").write_text(json.dumps([[10, 1, 1, 1], [1, 1, 5, 1]]))
    (folder / "patterns.txt").write_text("phalanx\nhello\n")
    (folder / "image.png").write_bytes(_png())
    cfg = model_config("tiny")
    hf.save(init_weights(build_model(cfg), cfg, seed=0, device="cpu"), folder / "hf")
    (folder / "run" / "checkpoints").mkdir(parents=True)
    return {"text": str(folder / "text.txt"), "jsonl": str(folder / "data.jsonl"), "model": str(folder / "model.json"),
            "load": str(folder / "load.json"), "patterns": str(folder / "patterns.txt"), "png": str(folder / "image.png"),
            "hf": str(folder / "hf"), "run": str(folder / "run")}


def _bad_file(kind: str, suffix: str, folder: Path) -> str:
    path = folder / f"bad{suffix or '_path'}"
    if kind == "missing":
        return str(path)
    if kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 8)
    elif kind == "truncated":
        whole = _png() if suffix == ".png" else GOOD_TEXT.get(suffix, '{"a": [1, 2').encode()
        path.write_bytes(whole[: max(1, len(whole) // 2 - 3)] if suffix != ".txt" else b"\xff\xfe\x00" + whole[:7])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "proc":
        return "/proc/self/mem" if suffix else "/proc/self"  # a file whose every read fails
    return str(path)


def _bad_output(kind: str, folder: Path) -> str:
    if kind == "unwritable":
        return "/proc/phalanx-out/x"
    if kind == "proc":
        return "/proc/self/status"
    (folder / "a_file").write_text("mine")
    return str(folder / "a_file" / "out")


def _cases():
    for verb, row in VERBS.items():
        for name, spec in row.files.items():
            for kind in FILE_KINDS if isinstance(spec, str) else spec[1]:
                yield pytest.param(verb, name, "file", kind, id=f"{verb}-{name}-{kind}")
        for name in row.outputs:
            for kind in OUTPUT_KINDS:
                yield pytest.param(verb, name, "output", kind, id=f"{verb}-{name}-{kind}")
        for name, kinds in row.numbers.items():
            for kind in kinds:
                yield pytest.param(verb, name, "number", kind, id=f"{verb}-{name}-{kind}")
        for name, texts in row.contents.items():
            for kind in texts:
                yield pytest.param(verb, name, "content", kind, id=f"{verb}-{name}-content-{kind}")


def _with(argv: list[str], name: str, value: str) -> list[str]:
    """argv with `name` (a flag or a <placeholder>) set to value."""
    if name.startswith("<"):
        return [value if part == name else part for part in argv]
    if name in argv:
        at = argv.index(name)
        return [*argv[: at + 1], value, *argv[at + 2 :]]
    return [*argv, name, value]


def _files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("verb, name, where, kind", list(_cases()))
def test_bad_input(verb, name, where, kind, good, tmp_path, monkeypatch, capsys, record_property):
    monkeypatch.chdir(tmp_path)  # default outputs (runs/, simulation/) would land here
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    row = VERBS[verb]
    if where == "file":
        spec = row.files[name]
        bad = _bad_file(kind, spec if isinstance(spec, str) else spec[0], inputs)
    elif where == "output":
        bad = _bad_output(kind, inputs)
    elif where == "content":
        bad = str(inputs / "load.json")
        Path(bad).write_text(row.contents[name][kind])
    else:
        bad = HUGE_INT if kind == "huge" and name not in ("--lr", "--val-fraction", "--temperature", "--top-p", "--sigma",
                                                          "--collective-timeout", "--kv-cache-memory", "--ttft-ms",
                                                          "--tpot-ms", "--rate", "--shutdown-grace") else NUMBER_KINDS[kind]
    argv = _with(row.argv, name, bad)
    # <out...>: an output of this test's own (its name as given), any other <name> a good input.
    argv = [good.get(part.strip("<>"), str(tmp_path / part.strip("<>"))) if part.startswith("<") else part for part in argv]
    before = _files_under(tmp_path)
    began = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    record_property("seconds", round(time.perf_counter() - began, 3))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith("phalanx: error: "), (argv, err)
    assert "Traceback" not in err[0]
    shown = {name, name.lstrip("-").replace("-", "_"), bad, Path(bad).name} if where != "content" else {bad, "load"}
    assert any(part in err[0] for part in shown if part), (argv, err[0])
    assert _files_under(tmp_path) == before, f"left behind: {_files_under(tmp_path) - before}"


ODD_VALUES = [
    # (argv with <placeholders> as above, a text the one error line must hold)
    pytest.param(["serve", "--model", "<hf>", "--host", ""], "--host", id="serve-host-empty"),
    pytest.param(["serve", "--model", "<hf>", "--host", "999.1.1.1"], "999.1.1.1", id="serve-host-not-an-address"),
    pytest.param(["serve", "--model", "<hf>", "--api-key", "k", "--api-key-file", "<text>"], "--api-key",
                 id="serve-two-keys"),
    pytest.param(["serve", "--model", "<hf>", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
                 "--speculative-config", id="serve-speculative-method-unknown"),
    pytest.param(["serve", "--model", "<hf>", "--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 0}'],
                 ">= 1", id="serve-speculative-mtp-tokens"),
    pytest.param(["serve", "--model", "<hf>", "--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'],
                 "DeepSeek-V3-family", id="serve-speculative-mtp-not-deepseek"),
    pytest.param(["serve", "--model", "<hf>", "--pool", "auto", "--nproc", "1024", "--tpot-ms", "50"], "--nproc 1024",
                 id="serve-pool-auto-nproc-past-the-machine"),
    pytest.param(["serve", "--model", "<hf>", "--pool", "auto", "--nproc", str(usable_cores() + 1), "--tpot-ms", "50"],
                 "one rank per core", id="serve-pool-auto-nproc-past-the-cores"),
    pytest.param(["plan", "--serve", *SERVE_PLAN_BASE[:-4], "--isl", "2000", "--osl", "64"], "--isl 2000",
                 id="plan-serve-isl-beyond-positions"),
    pytest.param(["simulate", "--serve", *SERVE_PLAN_BASE[:-4], "--isl", "2000", "--osl", "64", "--rate", "2",
                  "--requests", "10", "--out", "<out>"], "--isl 2000", id="simulate-serve-isl-beyond-positions"),
    pytest.param(["simulate", "--serve", *SERVE_PLAN_BASE, "--rate", "2", "--requests", "1000000", "--out", "<out>"],
                 "--requests 1000000", id="simulate-serve-requests-unbounded"),
    pytest.param(["simulate", "--serve", *SERVE_PLAN_BASE[:-4], "--isl", "1", "--osl", "2000", "--rate", "2",
                  "--requests", "500", "--out", "<out>"], "--osl 2000", id="simulate-serve-long-outputs"),
]


@pytest.mark.parametrize("argv, shown", ODD_VALUES)
def test_odd_value(argv, shown, good, tmp_path, monkeypatch, capsys):
    """Values no kind above makes: each a one-line error, exit 2, nothing left behind."""
    monkeypatch.chdir(tmp_path)
    argv = [good.get(part.strip("<>"), str(tmp_path / part.strip("<>"))) if part.startswith("<") else part for part in argv]
    before = _files_under(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith("phalanx: error: ") and shown in err[0], (argv, err)
    assert _files_under(tmp_path) == before


BAD_STARTS = {"negative": [0, -4, 9], "unsorted": [0, 30, 9], "past the tokens": [0, 10, 10**9],
              "float": [0.0, 9.5], "empty": [], "no leading 0": [3, 9], "2-D": [[0, 9], [20, 40]]}


@pytest.mark.parametrize("kind", list(BAD_STARTS))
def test_doc_mask_refuses_bad_document_starts(kind, good, tmp_path, monkeypatch, capsys):
    """`train --doc-mask` on a prepared directory whose train_documents.npy is damaged."""
    import numpy as np

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    with pytest.raises(SystemExit) as prepared:
        main(["prepare", good["jsonl"], "--tokenizer", "bytes", "--out", str(data), "--no-progress", "--workers", "1",
              "--val-fraction", "0.2"])
    assert prepared.value.code in (0, None)
    capsys.readouterr()
    starts = np.array(BAD_STARTS[kind])
    np.save(data / "train_documents.npy", starts if kind == "float" or starts.size else starts.astype(np.int64))
    argv = [good.get(part.strip("<>"), str(tmp_path / part.strip("<>"))) if part.startswith("<") else part
            for part in _with(_with(TRAIN_BASE, "--data", str(data)), "--doc-mask", "")]
    argv.remove("")
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    assert len(err) == 1 and err[0].startswith("phalanx: error: ") and "train_documents.npy" in err[0], err
