"""The energy a rank's GPU draws, from NVML's total-energy counter, for the `energy_j` of each
step's row in metrics.jsonl (step_sync.py sums it over the ranks).

NVML (`nvmlDeviceGetTotalEnergyConsumption`, through the `pynvml` module of the
`nvidia-ml-py` package: `pip install phalanx[gpu]`) counts the millijoules a GPU has drawn
since its driver loaded, on Volta and later. The counter is read at two points where the
device has finished the work queued before them, and the difference is the energy between
them. Where it cannot be read there is no `energy_j`, and the reason is said once:
- on CPU nothing is read at all (`counter_for` is not called off CUDA);
- no `pynvml` module, or NVML's library not loadable (no driver): not measured;
- a GPU without the counter (before Volta; MIG instances) answers NOT_SUPPORTED: not measured;
- the counter is an unsigned 64-bit number: a reading below the last is a wrap when the
  difference modulo 2**64 is small (`counter_delta_mj`), else (a reset) that step has none.

Torch-free: the trainer passes the device's UUID (`torch.cuda.get_device_properties(i).uuid`,
which follows CUDA_VISIBLE_DEVICES, where NVML's own indices do not).
"""

from __future__ import annotations

from types import ModuleType

COUNTER_MODULUS = 2**64
"""NVML's counter is an unsigned long long of millijoules."""


def counter_delta_mj(before: int, after: int) -> int | None:
    """Millijoules between two readings: the difference modulo 2**64, so a counter that wrapped
    past its top counts on; None when that difference is implausibly large (over 2**63 mJ,
    some 2,500 GWh: the counter went back, a reset, not a wrap)."""
    delta = (after - before) % COUNTER_MODULUS
    return delta if delta < COUNTER_MODULUS // 2 else None


def nvml_handle_names(uuid: str) -> list[str]:
    """The names NVML may know the device by: CUDA's UUID has no prefix, NVML's has `GPU-`
    (a whole GPU) or `MIG-` (a MIG instance)."""
    if uuid.startswith(("GPU-", "MIG-")):
        return [uuid]
    return [f"GPU-{uuid}", f"MIG-{uuid}"]


class EnergyCounter:
    """One GPU's counter: `read_j()` gives the joules since the last read (or since it opened),
    or None where this reading failed or went back."""

    def __init__(self, nvml: ModuleType, handle, first_mj: int):
        self.nvml, self.handle, self.last_mj = nvml, handle, first_mj

    def read_j(self) -> float | None:
        try:
            now = int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except self.nvml.NVMLError:  # the GPU lost, the driver gone: no figure for this step
            return None
        delta = counter_delta_mj(self.last_mj, now)
        self.last_mj = now
        return None if delta is None else delta / 1000.0

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()  # reference-counted: one per nvmlInit
        except self.nvml.NVMLError:
            pass


def _pynvml() -> ModuleType:
    # Imported when run, not at the top: only a CUDA run reads energy, and a CPU install has no pynvml.
    import pynvml

    return pynvml


def counter_for(uuid: str, nvml: ModuleType | None = None) -> tuple[EnergyCounter | None, str]:
    """(the counter of the GPU with this UUID, "") or (None, why it cannot be read). `nvml`:
    a module with pynvml's names (tests pass a fake), else pynvml."""
    if nvml is None:
        try:
            nvml = _pynvml()
        except ImportError:
            return None, "no pynvml module (pip install nvidia-ml-py, or phalanx[gpu])"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        return None, f"NVML did not start ({error})"
    handle, tried = None, []
    for name in nvml_handle_names(uuid):
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(name.encode())  # bytes: what every pynvml passes to C
            break
        except nvml.NVMLError as error:
            tried.append(f"{name}: {error}")
    if handle is None:
        nvml.nvmlShutdown()
        return None, f"NVML does not know this GPU ({'; '.join(tried)})"
    try:
        first = int(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except nvml.NVMLError as error:
        nvml.nvmlShutdown()
        if getattr(error, "value", None) == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", object()):
            return None, "this GPU has no energy counter (NVML: not supported; it needs Volta or later, not MIG)"
        return None, f"NVML's energy counter did not read ({error})"
    return EnergyCounter(nvml, handle, first), ""
