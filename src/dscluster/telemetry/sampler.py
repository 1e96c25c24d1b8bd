"""The sampler's run loop: lock, sample every period, append a JSON line, stop cleanly.

Why each piece is here:
- the lock (fcntl.flock on telemetry/.<hostname>.lock) makes "one sampler per node" true even
  when every rank's entry script tries to start one: the losers exit 0 saying so;
- `--parent-pid` ties the sampler's life to training's, so no sampler outlives its job;
- SIGTERM/SIGINT end the loop between samples, write an "end" line and exit 0, so the file
  is always complete JSON lines and a launcher's cleanup is not reported as a failure.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

import psutil

from dscluster.files.fsutil import JsonlWriter, StorageFull
from dscluster.rundir.layout import TELEMETRY_DIR
from dscluster.telemetry.backends import GpuBackend, select_backend


@dataclass
class SamplerConfig:
    run_dir: Path
    period: float = 1.0
    """Seconds between samples: often enough for `top`, rare enough that the sampler costs little."""
    backend: str = "auto"
    """auto (NVML, else GPUtil, else none), nvml, gputil or none."""
    duration: float | None = None
    """Stop after this many seconds (None: until signalled or the parent exits)."""
    parent_pid: int | None = None
    """Exit when this process is gone (the training process this sampler serves)."""
    hostname: str | None = None
    """Override the file name's host (default: socket.gethostname(), like `hostname`)."""
    pcie: bool = True
    """Query PCIe throughput (NVML samples it over a window on every call)."""


def telemetry_path(run_dir: Path, hostname: str) -> Path:
    return Path(run_dir) / TELEMETRY_DIR / f"{hostname}.jsonl"


def lock_path(run_dir: Path, hostname: str) -> Path:
    return Path(run_dir) / TELEMETRY_DIR / f".{hostname}.lock"


def job_interface(env: dict[str, str] | None = None) -> str | None:
    """The interface the job's traffic uses: the node env's NCCL/GLOO_SOCKET_IFNAME from `dscluster
    check` (entry_cn.sh sources it before starting the sampler); the first one where a list is given."""
    env = os.environ if env is None else env
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = (env.get(key) or "").lstrip("^=").split(",")[0].strip()
        if value:
            return value
    return None


def net_counters(iface: str | None) -> tuple[str, int, int] | None:
    """(interface, bytes received, bytes sent) since boot; without an interface, all but loopback."""
    nics = psutil.net_io_counters(pernic=True)
    if iface:
        c = nics.get(iface)
        return (iface, c.bytes_recv, c.bytes_sent) if c else None
    others = [c for name, c in nics.items() if name != "lo"]
    return ("all", sum(c.bytes_recv for c in others), sum(c.bytes_sent for c in others)) if others else None


class HostSampler:
    """CPU and RAM of the node plus the sampler's own CPU, all through psutil, and the byte counters
    of the job's network interface (`job_interface`), from which readers take bytes per second."""

    def __init__(self, iface: str | None = None):
        self.iface = iface if iface is not None else job_interface()
        self._proc = psutil.Process()
        # psutil's percentages are "since the previous call": prime them so the first
        # sample is a real measurement, not 0.0.
        psutil.cpu_percent(interval=None)
        self._proc.cpu_percent(interval=None)

    def sample(self) -> dict[str, Any]:
        vm = psutil.virtual_memory()
        net = net_counters(self.iface)
        return {
            "cpu_percent": psutil.cpu_percent(interval=None),
            "ram_used_mb": round((vm.total - vm.available) / 2**20, 1),
            "ram_total_mb": round(vm.total / 2**20, 1),
            "proc_cpu_percent": self._proc.cpu_percent(interval=None),
            "net_iface": net[0] if net else self.iface,
            "net_rx_bytes": net[1] if net else None,
            "net_tx_bytes": net[2] if net else None,
        }

    @staticmethod
    def own_cpu_seconds() -> float:
        """This process's CPU time (ns resolution; psutil's cpu_times ticks in 10 ms)."""
        return time.process_time()


def parent_alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return psutil.pid_exists(pid) if pid > 0 else False


class _NodeLock:
    """Exclusive, non-blocking flock; released by the kernel if the sampler dies."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def run_sampler(
    cfg: SamplerConfig,
    *,
    log: TextIO = sys.stderr,
    stop_event: threading.Event | None = None,
    install_signal_handlers: bool = True,
    backend: GpuBackend | None = None,
    clock: Callable[[], float] = time.time,
) -> int:
    """Sample until duration, signal, parent exit or stop_event; returns the exit code (0)."""
    hostname = cfg.hostname or socket.gethostname()
    lock = _NodeLock(lock_path(cfg.run_dir, hostname))
    if not lock.acquire():
        print(f"telemetry: another sampler (pid {lock.holder()}) already writes "
              f"{telemetry_path(cfg.run_dir, hostname)}; this one exits", file=log)
        return 0
    stop = stop_event or threading.Event()
    reason: dict[str, str | None] = {"why": None}  # why the loop ended; the signal handler sets it too
    previous = _stop_on_signals(stop, reason) if install_signal_handlers else {}
    backend, message = _choose_backend(cfg, backend)
    host = HostSampler()
    path = telemetry_path(cfg.run_dir, hostname)
    start_wall, start_mono = clock(), time.monotonic()
    start_cpu = host.own_cpu_seconds()
    samples = 0
    print(f"telemetry: {message}; writing {path} every {cfg.period:g} s", file=log)
    try:
        with JsonlWriter(path) as out:
            out.write({
                "kind": "meta", "t": start_wall, "host": hostname, "backend": backend.name,
                "backend_message": message, "period": cfg.period, "pid": os.getpid(),
                "parent_pid": cfg.parent_pid, "cpu_count": psutil.cpu_count(),
            })
            samples = _sample_until_stopped(cfg, out, hostname=hostname, backend=backend, host=host, stop=stop,
                                            reason=reason, log=log, clock=clock, start_mono=start_mono)
            # The end line's own cost figures are what shows the sampler stays cheap beside training.
            wall = time.monotonic() - start_mono
            cpu = host.own_cpu_seconds() - start_cpu
            try:
                out.write({
                    "kind": "end", "t": clock(), "host": hostname, "backend": backend.name,
                    "reason": reason["why"] or "stopped", "samples": samples, "wall_s": round(wall, 3),
                    "cpu_s": round(cpu, 4), "cpu_percent_of_core": round(100.0 * cpu / wall, 3) if wall > 0 else None,
                })
            except StorageFull as e:
                print(f"telemetry: warning: no end record: {e}", file=log)
    finally:
        backend.close()
        lock.release()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"telemetry: stopped ({reason['why'] or 'stopped'}), {samples} samples in {path}", file=log)
    return 0


def _stop_on_signals(stop: threading.Event, reason: dict[str, str | None]) -> dict[Any, Any]:
    """SIGTERM/SIGINT end the loop between samples (so the file ends whole); returns the handlers to restore."""
    def _on_signal(signum, _frame):
        reason["why"] = signal.Signals(signum).name
        stop.set()

    return {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}


def _choose_backend(cfg: SamplerConfig, backend: GpuBackend | None) -> tuple[GpuBackend, str]:
    if backend is not None:
        return backend, f"backend {backend.name} (given)"
    choice = select_backend(cfg.backend, pcie=cfg.pcie)
    return choice.backend, choice.message


def _sample_once(hostname: str, backend: GpuBackend, host: HostSampler, clock: Callable[[], float]) -> dict:
    record: dict[str, Any] = {"kind": "sample", "t": clock(), "host": hostname, "backend": backend.name}
    record.update(host.sample())
    try:
        record["gpus"] = backend.sample()
    except Exception as e:  # a driver hiccup must not end the record
        record["gpus"] = []
        record["error"] = f"{type(e).__name__}: {e}"
    return record


def _sample_until_stopped(cfg: SamplerConfig, out: JsonlWriter, *, hostname: str, backend: GpuBackend,
                          host: HostSampler, stop: threading.Event, reason: dict[str, str | None], log: TextIO,
                          clock: Callable[[], float], start_mono: float) -> int:
    """The loop: one sample line per period until stopped; returns how many lines were written."""
    samples = 0
    next_tick = start_mono
    full = None
    while not stop.is_set():
        if cfg.parent_pid is not None and not parent_alive(cfg.parent_pid):
            reason["why"] = f"parent {cfg.parent_pid} exited"
            break
        record = _sample_once(hostname, backend, host, clock)
        try:
            out.write(record)
            samples += 1
            full = None
        except StorageFull as e:  # training goes on; the record resumes whole once there is room
            if full is None:
                print(f"telemetry: warning: {e}; sampling goes on, writing again once there is room", file=log)
            full = e
        if cfg.duration is not None and time.monotonic() - start_mono >= cfg.duration:
            reason["why"] = "duration reached"
            break
        # Fixed-rate schedule: a slow sample does not stretch every later period.
        next_tick += cfg.period
        delay = next_tick - time.monotonic()
        if delay < 0:
            next_tick = time.monotonic()
            delay = 0
        stop.wait(delay)
    return samples
