"""What this machine has: GPUs through NVML (nvidia-ml-py), RAM and cores through psutil.

`probe_hardware(nvml=...)` is the seam: tests hand it a fake NVML module (an 8 GiB GPU) and
the rest of the planner runs unchanged. No GPU, no driver or no NVML library all mean the
same thing to the planner: an empty GPU list, and a CPU-only plan.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any, Callable

import psutil


@dataclass(frozen=True)
class GpuInfo:
    name: str
    total_bytes: int
    free_bytes: int
    pcie_generation: int | None = None  # the most the device and this slot allow
    pcie_width: int | None = None
    memory_bandwidth_gbs: float | None = None  # theoretical peak: bus width x max memory clock x 2 (DDR)


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[GpuInfo, ...]
    ram_total_bytes: int
    ram_available_bytes: int
    physical_cores: int
    logical_cores: int

    @property
    def gpu(self) -> GpuInfo | None:
        """The GPU the engine uses (the first, as `--device cuda` does)."""
        return self.gpus[0] if self.gpus else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Hardware:
        return cls(**{**d, "gpus": tuple(GpuInfo(**g) for g in d["gpus"])})


def _nvml_module() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _optional(call: Callable[..., Any], *args: Any) -> Any:
    """An NVML query that some GPUs, drivers or virtual machines do not answer."""
    try:
        return call(*args)
    except Exception:  # NVMLError_NotSupported and kin: the planner falls back to assumptions
        return None


def _gpu(nvml: ModuleType, index: int) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = nvml.nvmlDeviceGetName(handle)
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    bus_bits = _optional(nvml.nvmlDeviceGetMemoryBusWidth, handle)
    mem_mhz = _optional(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_MEM)
    bandwidth = bus_bits / 8 * mem_mhz * 2 / 1000 if bus_bits and mem_mhz else None
    return GpuInfo(
        name=name.decode() if isinstance(name, bytes) else str(name),
        total_bytes=int(mem.total), free_bytes=int(mem.free),
        # The current link drops to gen 1 when idle to save power; the maximum is what copies get.
        pcie_generation=_optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        pcie_width=_optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        memory_bandwidth_gbs=round(bandwidth, 1) if bandwidth else None,
    )


def probe_gpus(nvml: ModuleType | None) -> tuple[GpuInfo, ...]:
    if nvml is None:
        return ()
    try:
        nvml.nvmlInit()
    except Exception:  # no driver or no NVIDIA GPU: a CPU-only machine
        return ()
    try:
        return tuple(_gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount()))
    finally:
        nvml.nvmlShutdown()


def probe_hardware(nvml: ModuleType | None | bool = True) -> Hardware:
    """`nvml`: True = the real pynvml (when installed), None = no GPUs, or a module-like fake."""
    module = _nvml_module() if nvml is True else nvml
    vm = psutil.virtual_memory()
    logical = psutil.cpu_count(logical=True) or 1
    return Hardware(gpus=probe_gpus(module), ram_total_bytes=int(vm.total), ram_available_bytes=int(vm.available),
                    physical_cores=psutil.cpu_count(logical=False) or logical, logical_cores=logical)
