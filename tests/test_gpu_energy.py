"""The GPU energy of each training step (`energy_j` in metrics.jsonl, phalanx/train/gpu_energy.py
and step_sync.py), on the CPU with a fake NVML module in place of pynvml: the counter's
reading and difference, its wrap, the GPUs without a counter, no NVML at all, the sum over the
ranks in the step's one all-reduce, and that a CPU run reads nothing. The fake has pynvml's
names, and where nvidia-ml-py is installed a test checks the real module has them too.

Exact comparisons: the joules are millijoule integers over 1000 and small sums of them."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch

from phalanx.testing.fork_ranks import run_ranks
from phalanx.train.gpu_energy import COUNTER_MODULUS, counter_delta_mj, counter_for

UUID = "0e4a7c2b-1111-2222-3333-444455556666"
"""A device's UUID as torch.cuda.get_device_properties(i).uuid prints it: no prefix."""
NAMES_USED = ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetTotalEnergyConsumption",
              "NVMLError", "NVML_ERROR_NOT_SUPPORTED")


def fake_nvml(readings=(), *, known=(f"GPU-{UUID}",), supported=True, starts=True) -> types.ModuleType:
    """A module with pynvml's names: `known` the UUIDs it has a device for, whose counter gives
    `readings` (millijoules) in turn; an int 0 in them fails that read."""
    nvml = types.ModuleType("pynvml")
    nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_ERROR_LIBRARY_NOT_FOUND = 3, 6, 12
    nvml.NVML_ERROR_GPU_IS_LOST = 15

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(f"NVML error {value}")
            self.value = value

    nvml.NVMLError = NVMLError
    nvml.calls, left = [], list(readings)

    def nvmlInit():
        nvml.calls.append("init")
        if not starts:
            raise NVMLError(nvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def nvmlShutdown():
        nvml.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(uuid):
        assert isinstance(uuid, bytes)  # older pynvml releases pass it to C as given
        if uuid.decode() not in known:
            raise NVMLError(nvml.NVML_ERROR_NOT_FOUND)
        return ("handle", uuid.decode())

    def nvmlDeviceGetTotalEnergyConsumption(handle):
        assert handle[0] == "handle"
        if not supported:
            raise NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
        value = left.pop(0)
        if value == 0:
            raise NVMLError(nvml.NVML_ERROR_GPU_IS_LOST)
        return value

    for fn in (nvmlInit, nvmlShutdown, nvmlDeviceGetHandleByUUID, nvmlDeviceGetTotalEnergyConsumption):
        setattr(nvml, fn.__name__, fn)
    return nvml


def test_the_counter_gives_the_joules_between_readings():
    counter, why = counter_for(UUID, fake_nvml([1_000, 3_500, 3_500, 10_250]))
    assert why == "" and counter.handle == ("handle", f"GPU-{UUID}")
    assert [counter.read_j(), counter.read_j(), counter.read_j()] == [2.5, 0.0, 6.75]


def test_a_failed_read_has_no_figure_and_the_next_counts_from_the_last_good_one():
    counter, _ = counter_for(UUID, fake_nvml([1_000, 0, 4_000]))
    assert counter.read_j() is None
    assert counter.read_j() == 3.0


def test_the_counter_wrapping_past_its_top_counts_on_and_a_reset_gives_nothing():
    assert counter_delta_mj(COUNTER_MODULUS - 500, 700) == 1_200  # wrapped: 500 to the top, 700 after
    assert counter_delta_mj(5_000, 100) is None  # went back: a reset, not a wrap
    counter, _ = counter_for(UUID, fake_nvml([COUNTER_MODULUS - 2_000, 1_000, 900, 2_900]))
    assert [counter.read_j(), counter.read_j(), counter.read_j()] == [3.0, None, 2.0]


def test_a_mig_instance_is_found_by_its_mig_uuid():
    counter, why = counter_for(UUID, fake_nvml([10, 20], known=(f"MIG-{UUID}",)))
    assert why == "" and counter.handle == ("handle", f"MIG-{UUID}")


def test_a_gpu_without_the_counter_is_not_measured_and_says_why():
    nvml = fake_nvml(supported=False)
    counter, why = counter_for(UUID, nvml)
    assert counter is None and "no energy counter" in why and "Volta" in why
    assert nvml.calls == ["init", "shutdown"]


def test_no_nvml_library_or_no_device_is_not_measured_and_says_why():
    counter, why = counter_for(UUID, fake_nvml(starts=False))
    assert counter is None and why.startswith("NVML did not start")
    counter, why = counter_for(UUID, fake_nvml([1], known=()))
    assert counter is None and why.startswith("NVML does not know this GPU") and f"GPU-{UUID}" in why


def test_no_pynvml_module_is_not_measured_and_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    counter, why = counter_for(UUID)
    assert counter is None and "nvidia-ml-py" in why


def test_the_real_pynvml_has_the_fakes_names():
    pynvml = pytest.importorskip("pynvml")
    assert all(hasattr(pynvml, name) for name in NAMES_USED)
    error = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    assert isinstance(error, pynvml.NVMLError) and error.value == 3
    counter, why = counter_for(UUID, pynvml)  # here: no NVML library; on a GPU node: no such GPU
    assert counter is None and why.startswith(("NVML did not start", "NVML does not know this GPU"))


def test_a_cuda_rank_opens_its_gpus_counter_by_uuid_and_a_cpu_rank_reads_nothing(monkeypatch, capsys):
    from phalanx.train import run_setup

    def refuse(*_):
        raise AssertionError("a CPU run must not touch NVML")

    monkeypatch.setattr(run_setup, "counter_for", refuse)
    assert run_setup.energy_counter(torch.device("cpu"), rank=0) is None
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid=UUID))
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([5_000, 7_000]))
    counter = run_setup.energy_counter(torch.device("cuda", 0), rank=0)
    assert counter.read_j() == 2.0
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(supported=False))
    assert run_setup.energy_counter(torch.device("cuda", 0), rank=1) is None
    assert capsys.readouterr().err == ""  # only rank 0 says why
    assert run_setup.energy_counter(torch.device("cuda", 0), rank=0) is None
    assert "phalanx: note: no energy_j in metrics.jsonl: this GPU has no energy counter" in capsys.readouterr().err


class _Counter:
    def __init__(self, joules):
        self.joules = joules

    def read_j(self):
        return self.joules


def _agree_energy(joules_by_rank: dict):
    import torch.distributed as dist

    from phalanx.train.step_sync import StepSync

    rank = dist.get_rank()
    counter = _Counter(joules_by_rank[rank]) if rank in joules_by_rank else None
    sync = StepSync(torch.device("cpu"), None, energy=counter)
    agreed = sync.agree(torch.tensor(float(rank + 1)), peak_mb=100.0 + rank, compute_s=0.5, wait_s=0.25)
    return agreed.energy_j, agreed.loss, agreed.peak_mb_by_rank, agreed.compute_s_by_rank, agreed.wait_s_by_rank


def test_the_steps_all_reduce_sums_every_ranks_energy_and_none_where_a_rank_has_none():
    """3 ranks with 1.5, 3 and 4.5 J: 9 J on every rank, the other figures in their slots as
    before; a rank without a reading (its read failed, or no counter) leaves the sum out."""
    expected = (9.0, 2.0, [100.0, 101.0, 102.0], [0.5] * 3, [0.25] * 3)
    assert run_ranks(3, _agree_energy, {0: 1.5, 1: 3.0, 2: 4.5}) == [expected] * 3
    assert run_ranks(2, _agree_energy, {0: 1.5, 1: None}) == [(None, 1.5, [100.0, 101.0], [0.5] * 2, [0.25] * 2)] * 2
    assert run_ranks(2, _agree_energy, {}) == [(None, 1.5, [100.0, 101.0], [0.5] * 2, [0.25] * 2)] * 2


def test_one_process_reports_its_own_gpus_energy():
    from phalanx.train.step_sync import StepSync

    assert StepSync(torch.device("cpu"), None, energy=_Counter(2.5)).agree(torch.tensor(1.0), 5.0).energy_j == 2.5
    assert StepSync(torch.device("cpu"), None).agree(torch.tensor(1.0), 5.0).energy_j is None


def test_the_steps_row_and_tensorboard_carry_energy_j():
    from phalanx.train.step_sync import StepAgreement
    from phalanx.train.tensorboard_log import scalars
    from phalanx.train.train_step import step_record

    mesh = types.SimpleNamespace(device=torch.device("cpu"))
    agreed = StepAgreement(loss=2.0, stop=0, peak_mb_by_rank=None, energy_j=123.4567)
    record = step_record(1, agreed, 1e-3, 0.5, 0.25, tokens=1024, mesh=mesh, clock=None)
    assert record["energy_j"] == 123.457 and scalars(record)["energy/energy_j"] == 123.457
    record = step_record(1, StepAgreement(loss=2.0, stop=0, peak_mb_by_rank=None), 1e-3, 0.5, 0.25, tokens=1024,
                         mesh=mesh, clock=None)
    assert "energy_j" not in record and "energy/energy_j" not in scalars(record)


def test_a_training_run_writes_each_steps_energy_and_a_cpu_run_none(tiny_config, monkeypatch):
    """One process trains 4 steps: on the CPU its rows have no energy_j; with a counter in
    place of the GPU's (what `energy_counter` opens on CUDA) each row has the joules read at
    that step's agreement, and the counter is closed when the run ends."""
    from phalanx.train import run_setup
    from phalanx.train.loop import train
    from phalanx.train.metrics import read_metrics

    train(tiny_config, Path(tiny_config.out))
    rows = [r for r in read_metrics(Path(tiny_config.out) / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 4 and not any("energy_j" in r for r in rows)

    nvml = fake_nvml([1_000, 2_000, 3_500, 5_000, 7_250])
    counter, _ = counter_for(UUID, nvml)
    monkeypatch.setattr(run_setup, "energy_counter", lambda device, rank: counter)
    out = Path(tiny_config.out).with_name("run-energy")
    train(dataclasses.replace(tiny_config, out=str(out)), out)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["energy_j"] for r in rows] == [1.0, 1.5, 1.5, 2.25]
    assert nvml.calls == ["init", "shutdown"]


def test_an_unexpected_error_from_nvml_stops_no_run(monkeypatch, capsys):
    from phalanx.train import run_setup

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid=UUID))
    broken = fake_nvml([1])
    broken.nvmlDeviceGetHandleByUUID = lambda uuid: (_ for _ in ()).throw(TypeError("bytes or integer address expected"))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert run_setup.energy_counter(torch.device("cuda", 0), rank=0) is None
    assert "reading NVML failed (TypeError: bytes or integer address expected)" in capsys.readouterr().err
