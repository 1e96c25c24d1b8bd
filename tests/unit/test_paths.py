"""dscluster.paths finds entry_cn.sh, the presets and the venv in a checkout and in a
non-editable install (`pip install .`), whose wheel ships them as data files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import dscluster
from dscluster import paths

ROOT = Path(__file__).resolve().parents[2]


def test_in_the_checkout_everything_is_at_its_root():
    assert paths.checkout_root() == ROOT and paths.assets_root() == ROOT
    assert paths.entry_script() == ROOT / "entry_cn.sh" and os.access(paths.entry_script(), os.X_OK)
    assert paths.preset("digits") == paths.preset("configs/digits.yaml") == ROOT / "configs" / "digits.yaml"
    assert paths.preset("digits").is_file()
    if (ROOT / ".venv" / "bin" / "python").exists():
        assert paths.venv_bin() == ROOT / ".venv" / "bin"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building the wheel needs setuptools>=77 (PEP 639 licence fields); {setuptools.__version__} here")
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the wheel is made of: setuptools writes build/ and *.egg-info
    # beside pyproject.toml, which must not happen in a checkout others may be testing in.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "entry_cn.sh"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("configs", "src"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          str(src), "-w", str(out)], capture_output=True, text=True, timeout=300, cwd=src)
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("dscluster-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_ships_entry_script_presets_licence_and_one_version(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = {i.filename: i for i in z.infolist()}
        data = f"dscluster-{dscluster.__version__}.data/data/share/dscluster/"
        entry = names[data + "entry_cn.sh"]
        assert (entry.external_attr >> 16) & 0o111, "entry_cn.sh lost its executable bit"
        presets = {n.rsplit("/", 1)[1] for n in names if n.startswith(data + "configs/")}
        assert presets == {p.name for p in (ROOT / "configs").glob("*.yaml")}
        meta = z.read(f"dscluster-{dscluster.__version__}.dist-info/METADATA").decode()
    assert f"Version: {dscluster.__version__}\n" in meta and "License-Expression: MIT" in meta
    assert 'Requires-Dist: deepspeed; extra == "train"' in meta and "Requires-Dist: paramiko" in meta


@pytest.mark.slow
def test_installed_copy_finds_its_files_outside_any_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, timeout=300, capture_output=True)
    probe = ("from dscluster import paths; print(paths.checkout_root()); print(paths.entry_script()); "
             "print(paths.preset('digits')); print(paths.venv_dir())")
    # the base dependencies (PyYAML, rich, ...) from this venv, dscluster from the new one
    deps = next(p for p in sys.path if p.endswith("site-packages"))
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=dict(os.environ, PYTHONPATH=deps))
    assert out.returncode == 0, out.stderr
    share = venv / "share" / "dscluster"
    assert out.stdout.split() == ["None", str(share / "entry_cn.sh"), str(share / "configs" / "digits.yaml"),
                                  str(venv)]
    # entry_cn.sh runs from there: the user's program gets a run directory
    env = dict(os.environ, PYTHONPATH=deps, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
               DSCLUSTER_RUNS=str(tmp_path / "runs"))
    for key in ("OMPI_COMM_WORLD_RANK", "RANK", "DSCLUSTER_RUN_ID", "DSCLUSTER_VENV"):
        env.pop(key, None)
    res = subprocess.run([str(share / "entry_cn.sh"), "python", "-c",
                          "import os; print('rundir', os.environ['DSCLUSTER_RUN_DIR'])"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert f"rundir {tmp_path / 'runs'}" in res.stdout
