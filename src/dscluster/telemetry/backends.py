"""GPU sampling backends: NVML (primary), GPUtil (alternative), none (CPU-only node).

Every backend returns the same per-GPU record, with None where the card or backend cannot
say (an older Pascal card has no ECC, GPUtil knows no power or clocks), so analysis never
has to know which backend sampled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from dscluster.node.gpus import visible_indices

# NVML's clocks-event ("throttle") reason bits, from nvml.h. Kept here rather than read from
# pynvml so decoding works (and is tested) on machines without the NVML library.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}

# Reasons that mean "the card was slowed down by something the user should look at".
# gpu_idle and applications_clocks_setting are normal operation, not events.
SLOWDOWN_REASONS = frozenset({
    "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
    "hw_power_brake_slowdown", "board_limit", "reliability",
})


def decode_throttle_reasons(mask: int | None) -> list[str]:
    """Turn NVML's bitmask into names; unknown bits become 'bit_0xNNN' so nothing is hidden."""
    if mask is None:
        return []
    names = []
    remaining = int(mask)
    for bit, name in THROTTLE_REASONS.items():
        if remaining & bit:
            names.append(name)
            remaining &= ~bit
    bit = 1
    while remaining:
        if remaining & bit:
            names.append(f"bit_{bit:#x}")
            remaining &= ~bit
        bit <<= 1
    return names


class GpuBackend(Protocol):
    name: str

    def sample(self) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


def empty_gpu(index: int) -> dict[str, Any]:
    return {
        "index": index, "uuid": None, "name": None, "util_percent": None, "mem_used_mb": None,
        "mem_total_mb": None, "temp_c": None, "power_w": None, "sm_clock_mhz": None,
        "throttle_reasons": [], "ecc_errors": None, "pcie_tx_kbps": None, "pcie_rx_kbps": None,
    }


class NoneBackend:
    """CPU-only node (no NVIDIA driver): no GPU records, psutil data still flows."""

    name = "none"

    def sample(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


class NvmlBackend:
    """NVML via nvidia-ml-py. Each query is separate so one unsupported field (ECC on a
    consumer card, PCIe counters in a VM) leaves only that field null."""

    name = "nvml"

    def __init__(self, pcie: bool = True):
        import pynvml  # lazy and optional (nvidia-ml-py): only the backend chosen is loaded

        self._nvml = pynvml
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        static = [self._static_info(i, h) for i, h in enumerate(handles)]
        mine = visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), [s["uuid"] for s in static])
        self._handles = [handles[i] for i in mine]
        self._static = [static[i] for i in mine]
        # nvmlDeviceGetPcieThroughput samples over a window on every call; turning it off is
        # the knob when the sampler's own cost matters more than PCIe numbers.
        self._pcie = pcie

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _static_info(self, index: int, handle) -> dict[str, Any]:
        nvml = self._nvml
        name = self._try(nvml.nvmlDeviceGetName, handle)
        uuid = self._try(nvml.nvmlDeviceGetUUID, handle)
        return {
            "index": index,
            "name": name.decode() if isinstance(name, bytes) else name,
            "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
        }

    def sample(self) -> list[dict[str, Any]]:
        nvml = self._nvml
        out = []
        for handle, static in zip(self._handles, self._static, strict=True):
            gpu = empty_gpu(static["index"])
            gpu.update(static)
            util = self._try(nvml.nvmlDeviceGetUtilizationRates, handle)
            if util is not None:
                gpu["util_percent"] = float(util.gpu)
            mem = self._try(nvml.nvmlDeviceGetMemoryInfo, handle)
            if mem is not None:
                gpu["mem_used_mb"] = round(mem.used / 2**20, 1)
                gpu["mem_total_mb"] = round(mem.total / 2**20, 1)
            gpu["temp_c"] = self._try(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            power = self._try(nvml.nvmlDeviceGetPowerUsage, handle)  # milliwatts
            gpu["power_w"] = None if power is None else round(power / 1000.0, 1)
            gpu["sm_clock_mhz"] = self._try(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
            mask = self._try(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
            gpu["throttle_reasons"] = decode_throttle_reasons(mask)
            corrected = self._try(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                  nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)
            uncorrected = self._try(nvml.nvmlDeviceGetTotalEccErrors, handle,
                                    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
            if corrected is not None or uncorrected is not None:
                gpu["ecc_errors"] = {"corrected": corrected, "uncorrected": uncorrected}
            if self._pcie:
                gpu["pcie_tx_kbps"] = self._try(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
                gpu["pcie_rx_kbps"] = self._try(nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
            out.append(gpu)
        return out

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


class GputilBackend:
    """GPUtil (parses nvidia-smi). Knows utilisation, memory and temperature only."""

    name = "gputil"

    def __init__(self):
        # Lazy and optional: GPUtil 1.4.0 imports distutils, so it fails on Python 3.12+.
        import GPUtil

        self._gputil = GPUtil
        # GPUtil swallows a missing or failing nvidia-smi and returns []: decide now, not mid-run.
        gpus = self._gputil.getGPUs()
        if not gpus:
            raise RuntimeError("nvidia-smi reports no GPUs (or is not installed)")
        self._mine = {gpus[i].id for i in visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                         [g.uuid for g in gpus])}

    def sample(self) -> list[dict[str, Any]]:
        out = []
        for gpu in (g for g in self._gputil.getGPUs() if g.id in self._mine):
            g = empty_gpu(int(gpu.id))
            g.update({
                "uuid": gpu.uuid, "name": gpu.name,
                "util_percent": _finite(gpu.load * 100.0),
                "mem_used_mb": _finite(gpu.memoryUsed), "mem_total_mb": _finite(gpu.memoryTotal),
                "temp_c": _finite(gpu.temperature),
            })
            out.append(g)
        return out

    def close(self) -> None:
        pass


def _finite(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if x == x and x not in (float("inf"), float("-inf")) else None


@dataclass
class BackendChoice:
    backend: GpuBackend
    message: str  # one line for the user: why this backend was chosen


def _try_nvml(pcie: bool) -> tuple[GpuBackend | None, str]:
    try:
        return NvmlBackend(pcie=pcie), ""
    except ImportError as e:
        return None, f"nvml unavailable (nvidia-ml-py not installed: {e})"
    except Exception as e:  # pynvml.NVMLError_LibraryNotFound, driver errors
        return None, f"nvml unavailable ({type(e).__name__}: {e})"


def _try_gputil() -> tuple[GpuBackend | None, str]:
    try:
        return GputilBackend(), ""
    except (ImportError, ModuleNotFoundError) as e:
        return None, f"gputil unavailable ({e}; GPUtil 1.4.0 needs distutils, removed in Python 3.12)"
    except Exception as e:  # nvidia-smi missing or failing
        return None, f"gputil unavailable ({type(e).__name__}: {e})"


def select_backend(requested: str = "auto", pcie: bool = True) -> BackendChoice:
    """auto: NVML, else GPUtil, else none. An explicitly requested backend that cannot start
    falls back to "none" with the reason, so a sampler never takes a training run down."""
    if requested == "none":
        return BackendChoice(NoneBackend(), "backend none requested: CPU and RAM only")
    reasons = []
    order = {"auto": ("nvml", "gputil"), "nvml": ("nvml",), "gputil": ("gputil",)}[requested]
    for name in order:
        backend, reason = _try_nvml(pcie) if name == "nvml" else _try_gputil()
        if backend is not None:
            if name == "nvml" and not backend._handles:
                backend.close()
                reasons.append("nvml unavailable (driver reports 0 GPUs)")
                continue
            return BackendChoice(backend, f"backend {name}" + (f" ({'; '.join(reasons)})" if reasons else ""))
        reasons.append(reason)
    return BackendChoice(NoneBackend(), "no GPU backend, CPU and RAM only: " + "; ".join(reasons))
