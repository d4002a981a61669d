"""What this machine has: GPUs through NVML (nvidia-ml-py), RAM and cores through psutil, and
how fast this machine reads RAM, measured (a few hundred milliseconds, once per process).

`probe_hardware(nvml=...)` is the seam: tests hand it a fake NVML module (an 8 GiB GPU) and
the rest of the planner runs unchanged. No GPU, no driver or no NVML library all mean the
same thing to the planner: an empty GPU list, and a CPU-only plan.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import threading
import time
from functools import cache

import numpy as np
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
    # RAM read bandwidth measured here (GB/s) by one thread and by one thread per physical core;
    # None when not measured (a machine described rather than probed): the planner assumes then.
    ram_read_gbs_1: float | None = None
    ram_read_gbs: float | None = None
    # The widest vector extension ggml's CPU kernels use here (cpu_simd): "avx512", "avx2" or None.
    cpu_simd: str | None = None

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


BANDWIDTH_MIB = 256  # larger than any CPU's last-level cache, so the reads come from RAM
BANDWIDTH_PASSES = 3  # the fastest pass counts: the others were disturbed by something else


@cache
def measure_ram_read_gbs(threads: int) -> float | None:
    """GB/s at which `threads` threads read a 256 MiB array (numpy's max: vectorised, releases
    the GIL, so the reads, not the arithmetic, set its pace). What a decode token's weight reads
    can get at most; the planner's speed estimate divides the bytes a token reads by it. None
    when the array cannot be had (a memory limit): the plan then goes without the figure."""
    try:
        data = np.ones((BANDWIDTH_MIB << 20) // 4, np.float32)  # written once: the pages exist before timing
    except MemoryError:
        return None
    parts = np.array_split(data, threads)
    best = float("inf")
    for _ in range(BANDWIDTH_PASSES):
        workers = [threading.Thread(target=np.max, args=(part,)) for part in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return round(data.nbytes / best / 1e9, 1)


def cpu_simd(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The widest vector extension of this CPU that ggml's kernels use: "avx512" (AVX-512 F and
    BW), "avx2", or None where `cpuinfo` does not say (another system or architecture)."""
    try:
        line = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    flags = set(line.partition(":")[2].split())
    return "avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if "avx2" in flags else None


def probe_hardware(nvml: ModuleType | None | bool = True, bandwidth: bool = True) -> Hardware:
    """`nvml`: True = the real pynvml (when installed), None = no GPUs, or a module-like fake.
    `bandwidth`: measure the RAM read bandwidth (~0.3 s the first time in a process)."""
    module = _nvml_module() if nvml is True else nvml
    vm = psutil.virtual_memory()
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    one = measure_ram_read_gbs(1) if bandwidth else None
    # Every core reads at least as fast as one: less means other work took the cores meanwhile.
    every = max(one, measure_ram_read_gbs(physical)) if one else None
    return Hardware(gpus=probe_gpus(module), ram_total_bytes=int(vm.total), ram_available_bytes=int(vm.available),
                    physical_cores=physical, logical_cores=logical, ram_read_gbs_1=one, ram_read_gbs=every,
                    cpu_simd=cpu_simd())
