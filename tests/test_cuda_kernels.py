"""`phalanx match` and `phalanx blur` on CUDA give what they give on the CPU, as library calls
and as commands.

Matching is exact: counts and sorted positions equal, for both algorithms, on source text and
DNA, one input and several (matches across input borders must not count). Blur: both devices
filter in float32 with the same taps in the same order (rows, then columns); the GPU runs one
launch per tap over a tile, the CPU the same sums in strips, so the results agree to float32
rounding, within 1e-6 on values in [0, 1) (the CPU tests bound each against scipy at 1e-5).
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from phalanx.cli import main
from phalanx.kernels import blur, match
from tests.cuda_reference import CUDA_ONLY

pytestmark = CUDA_ONLY


def _texts() -> dict[str, tuple[list[bytes], list[bytes]]]:
    rng = random.Random(3)
    source = b"".join(p.read_bytes() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40])
    drawn = {source[s : s + rng.randint(3, 24)] for s in (rng.randrange(len(source) - 24) for _ in range(500))}
    dna = bytes(rng.choice(b"ACGT") for _ in range(200_000))
    motifs = {bytes(rng.choice(b"ACGT") for _ in range(rng.randint(2, 9))) for _ in range(300)}
    return {"source": (sorted(drawn), [source[:300_000], source[300_000:600_000]]), "dna": (sorted(motifs), [dna])}


@pytest.mark.parametrize("algorithm", ["wu-manber", "pfac"])
@pytest.mark.parametrize("kind", ["source", "dna"])
def test_match_on_cuda_equals_cpu(algorithm, kind):
    patterns, data = _texts()[kind]
    on_cpu = match(patterns, data, algorithm=algorithm, device="cpu", positions=True)
    on_gpu = match(patterns, data, algorithm=algorithm, device="cuda", positions=True)
    assert on_cpu["matches"] > 1000
    for key in ("matches", "per_pattern", "bytes", "positions"):
        assert on_gpu[key] == on_cpu[key], key


@pytest.mark.parametrize("shape, sigma, tiles", [((512, 384), 3.0, 4), ((97, 61, 3), 1.3, 3), ((64, 64), 12.0, 8)])
def test_blur_on_cuda_equals_cpu(shape, sigma, tiles):
    image = np.random.default_rng(sum(shape)).random(shape, dtype=np.float32)
    on_cpu = blur(image, sigma, tiles=tiles, device="cpu")
    on_gpu = blur(image, sigma, tiles=tiles, device="cuda")
    assert on_gpu.dtype == np.float32 and on_gpu.shape == image.shape
    assert np.abs(on_gpu - on_cpu).max() < 1e-6


def _command(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return out


def test_commands_on_cuda_equal_cpu(tmp_path, capsys):
    patterns, data = _texts()["source"]
    (tmp_path / "patterns.txt").write_bytes(b"\n".join(p for p in patterns if b"\n" not in p))
    for index, text in enumerate(data):
        (tmp_path / f"text{index}.txt").write_bytes(text)
    texts = [str(tmp_path / f"text{index}.txt") for index in range(len(data))]
    found = {device: json.loads(_command(capsys, "match", "--patterns", str(tmp_path / "patterns.txt"), "--json",
                                         "--positions", "--device", device, *texts)) for device in ("cuda", "cpu")}
    assert found["cuda"]["matches"] > 1000
    assert {k: v for k, v in found["cuda"].items() if k != "seconds"} == \
        {k: v for k, v in found["cpu"].items() if k != "seconds"}
    np.save(tmp_path / "in.npy", np.random.default_rng(9).random((300, 200), dtype=np.float32))
    for device in ("cuda", "cpu"):
        _command(capsys, "blur", str(tmp_path / "in.npy"), str(tmp_path / f"{device}.npy"), "--sigma", "2.5",
                 "--tiles", "3", "--device", device)
    assert np.abs(np.load(tmp_path / "cuda.npy") - np.load(tmp_path / "cpu.npy")).max() < 1e-6
