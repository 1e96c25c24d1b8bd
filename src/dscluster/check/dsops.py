"""DeepSpeed's ops a user's script commonly needs: prebuilt, JIT-buildable, or bound to fail.

A DeepSpeed Adam or Lamb optimizer loads FusedAdam/FusedLamb (CPUAdam under ZeRO-Offload) at
`deepspeed.initialize`; a pip-installed DeepSpeed compiles them on first use, which needs ninja, an
nvcc matching torch's CUDA major and a TORCH_CUDA_ARCH_LIST its builder can parse ("9.0a", which
torch accepts, makes it raise ValueError). `dscluster train` needs only CPUAdam, and only with
offload_optimizer=cpu, so a gap is a warning with the fix. `ds_op_facts()` runs on each node inside
check's probe (its source is sent alone: standard library only) and in `dscluster env`;
`ops_verdict()` and `arch_list_problem()` are the pure rules over those facts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

OPS = {"fused_adam": "FusedAdam", "fused_lamb": "FusedLamb", "cpu_adam": "CPUAdam"}
"""DeepSpeed's op name -> the class a user's config pulls in (CPUAdam: where ZeRO-Offload is on)."""
_ARCH_ENTRY = re.compile(r"^\d+\.\d+(\+PTX)?$")


def ds_op_facts() -> dict:
    """This machine's facts for the rule, without importing torch or DeepSpeed."""
    # Imports stay inside: check/probe.py sends this function's source alone to each node.
    import importlib.util
    import os
    import re as _re
    import shutil
    import subprocess
    import sys as _sys

    out: dict[str, Any] = {"installed_ops": None, "ds_accelerator": None, "ninja": False, "nvcc": None,
                           "torch_cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    spec = importlib.util.find_spec("deepspeed")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "git_version_info_installed.py")
        ns: dict = {}
        try:
            with open(path) as f:
                exec(compile(f.read(), path, "exec"), ns)
            out["installed_ops"] = dict(ns.get("installed_ops") or {})
            out["ds_accelerator"] = ns.get("accelerator_name")
        except (OSError, SyntaxError):
            pass
    # torch's extension builder runs `ninja` from PATH; entry_cn.sh puts the environment's bin/ first.
    bindir = os.path.dirname(_sys.executable)
    out["ninja"] = bool(shutil.which("ninja") or os.path.exists(os.path.join(bindir, "ninja")))
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = shutil.which("nvcc") or (os.path.join(home, "bin", "nvcc") if os.path.exists(
        os.path.join(home, "bin", "nvcc")) else None)
    if nvcc:
        try:
            text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
            m = _re.search(r"release (\d+\.\d+)", text)
            out["nvcc"] = m.group(1) if m else None
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def arch_list_problem(value: str | None) -> str | None:
    """Why DeepSpeed's builder cannot read TORCH_CUDA_ARCH_LIST, or None. It splits on ';' and
    spaces and reads each entry as major.minor numbers with an optional +PTX."""
    if not value:
        return None
    bad = [e for e in re.split(r"[;\s]+", value.strip()) if e and not _ARCH_ENTRY.match(e)]
    if not bad:
        return None
    return (f"TORCH_CUDA_ARCH_LIST={value!r} has {', '.join(repr(b) for b in bad)}, which DeepSpeed's op builder "
            "cannot parse (it reads X.Y or X.Y+PTX; an 'a' suffix such as 9.0a makes it raise ValueError)")


_SUFFIX = re.compile(r"^(\d+\.\d+)[A-Za-z]+(\+PTX)?$")


def usable_arch_list(value: str | None) -> str | None:
    """An arch list DeepSpeed's builder can parse, for a `value` it cannot: each entry's letter suffix
    dropped ('9.0a' -> '9.0', '10.0f+PTX' -> '10.0+PTX'), in order, once each. None where `value` is
    fine, or where an entry is not a suffixed X.Y (nothing safe to guess)."""
    if not arch_list_problem(value):
        return None
    out: list[str] = []
    for e in (e for e in re.split(r"[;\s]+", (value or "").strip()) if e):
        m = _ARCH_ENTRY.match(e) and e or ((g := _SUFFIX.match(e)) and g.group(1) + (g.group(2) or ""))
        if not m:
            return None
        out += [m] if m not in out else []
    return ";".join(out) or None


def arch_env(facts: dict | None) -> dict[str, str]:
    """What `dscluster check` writes into a node's env file (entry_cn.sh exports it) where the
    TORCH_CUDA_ARCH_LIST the node's ranks inherit would crash DeepSpeed's op builder; {} elsewhere."""
    usable = usable_arch_list((facts or {}).get("torch_cuda_arch_list"))
    return {"TORCH_CUDA_ARCH_LIST": usable} if usable else {}


def node_ops_findings(facts: dict | None, torch_cuda: str | None, on_gpu: bool) -> list[tuple[str, str, str]]:
    """(severity, what, fix) for one node: the arch list check mends (info), then what is still missing."""
    out = []
    mended = arch_env(facts)
    if mended:
        inherited = (facts or {}).get("torch_cuda_arch_list")
        out.append(("info", f"TORCH_CUDA_ARCH_LIST={inherited!r} would crash DeepSpeed's op builder (invalid literal "
                    f"for int(): the letter suffix); the node's env file sets "
                    f"TORCH_CUDA_ARCH_LIST={mended['TORCH_CUDA_ARCH_LIST']!r} for its ranks",
                    "nothing to do: entry_cn.sh exports it (outside entry_cn.sh, export it yourself)"))
    verdict = ops_verdict({**facts, "torch_cuda_arch_list": mended["TORCH_CUDA_ARCH_LIST"]} if mended and facts
                          else facts, torch_cuda, on_gpu)
    if verdict is not None and not verdict.ok:
        out.append(("warning", *ops_message(verdict)))
    return out


@dataclass
class OpsVerdict:
    ops: dict[str, str]
    """FusedAdam/FusedLamb/CPUAdam -> "prebuilt", "JIT-buildable" or "cannot build"."""
    problems: list[str]
    """Why the ones that cannot build cannot."""
    fixes: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        """'FusedAdam prebuilt, FusedLamb JIT-buildable, CPUAdam (ZeRO-Offload) cannot build'."""
        return ", ".join(f"{name}{' (ZeRO-Offload)' if name == 'CPUAdam' else ''} {state}"
                         for name, state in self.ops.items())


def _major(version: str | None) -> str | None:
    return version.split(".")[0] if version else None


def ops_verdict(facts: dict | None, torch_cuda: str | None, on_gpu: bool) -> OpsVerdict | None:
    """The rule. None where DeepSpeed is not installed (nothing to say)."""
    if not facts or facts.get("installed_ops") is None:
        return None
    installed = facts["installed_ops"]
    problems, fixes = [], []
    if not facts.get("ninja"):
        problems.append("no ninja (DeepSpeed JIT-builds its ops with it)")
        fixes.append("pip install ninja")
    arch = arch_list_problem(facts.get("torch_cuda_arch_list"))
    if on_gpu:
        nvcc = facts.get("nvcc")
        if not nvcc:
            problems.append("no nvcc (CUDA toolkit) on PATH or in CUDA_HOME")
            fixes.append(f"install the CUDA toolkit {torch_cuda or ''} and set CUDA_HOME".replace("  ", " "))
        elif torch_cuda and _major(nvcc) != _major(torch_cuda):
            problems.append(f"nvcc is CUDA {nvcc} but torch was built with CUDA {torch_cuda} (DeepSpeed requires the "
                            "same major version)")
            fixes.append(f"point CUDA_HOME at a CUDA {_major(torch_cuda)}.x toolkit")
        if arch:
            problems.append(arch)
            fixes.append("export TORCH_CUDA_ARCH_LIST without the suffix (e.g. '9.0' for 9.0a) or unset it")
    ops = {}
    for op, name in OPS.items():
        if installed.get(op):
            ops[name] = "prebuilt"
        elif op == "cpu_adam":  # a C++ op: needs ninja (and on a GPU node the CUDA headers nvcc brings)
            cpu_ok = facts.get("ninja") and (not on_gpu or (facts.get("nvcc") and not arch))
            ops[name] = "JIT-buildable" if cpu_ok else "cannot build"
        else:
            ops[name] = "JIT-buildable" if on_gpu and not problems else ("cannot build" if on_gpu else "needs a GPU")
    if all(state in ("prebuilt", "needs a GPU") for state in ops.values()):
        problems, fixes = [], []
    return OpsVerdict(ops, problems, fixes)


def ops_message(verdict: OpsVerdict) -> tuple[str, str]:
    """(what, fix) for check's finding and `dscluster env`'s line."""
    what = (f"DeepSpeed ops: {verdict.line()}: " + "; ".join(verdict.problems) +
            ". A script whose DeepSpeed config uses DeepSpeed's Adam/Lamb (or ZeRO-Offload) fails at "
            "deepspeed.initialize; dscluster train needs none of them but CPUAdam with offload_optimizer=cpu")
    fix = "; ".join(dict.fromkeys(verdict.fixes)) + (
        " (or prebuild: DS_BUILD_FUSED_ADAM=1 DS_BUILD_FUSED_LAMB=1 pip install deepspeed --no-build-isolation)")
    return what, fix
