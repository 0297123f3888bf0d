"""`phalanx generate --device cuda` prints the greedy tokens that `--device cpu` prints, fp32,
from the same random Hugging Face checkpoint (a llama and a mixtral: dense and MoE).

Greedy picks are equal, not close: the checkpoint's logits are O(1) (tests/hf_models.py), so
the top two of 96 differ by far more than fp32 rounding between devices (~1e-6).
"""

from __future__ import annotations

import json

import pytest

from phalanx.cli import main
from tests.cuda_reference import CUDA_ONLY
from tests.hf_models import write_checkpoint

pytestmark = CUDA_ONLY


def _generate(capsys, model, device: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(model), "--prompt-ids", "1,2,3,4,5", "--greedy", "--max-new-tokens", "12",
              "--json", "--device", device])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_greedy_on_cuda_equals_cpu(capsys, tmp_path, family):
    pytest.importorskip("transformers")  # here, not at import: collecting it on a CPU stays cheap
    checkpoint = write_checkpoint(tmp_path / family, family)
    on_gpu, on_cpu = _generate(capsys, checkpoint, "cuda"), _generate(capsys, checkpoint, "cpu")
    assert len(on_cpu["new_ids"]) == 12
    assert on_gpu["new_ids"] == on_cpu["new_ids"]
