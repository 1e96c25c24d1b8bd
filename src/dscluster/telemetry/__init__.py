"""Per-node telemetry: one sampler per node writes `runs/<id>/telemetry/<hostname>.jsonl`.

GPU data comes from a backend (NVML first, GPUtil as the alternative, "none" on CPU-only
nodes); CPU and RAM come from psutil always, so a CPU-only run still has a picture.
"""

from dscluster.telemetry.backends import THROTTLE_REASONS, decode_throttle_reasons, select_backend
from dscluster.telemetry.sampler import SamplerConfig, run_sampler

__all__ = ["THROTTLE_REASONS", "decode_throttle_reasons", "select_backend", "SamplerConfig", "run_sampler"]
