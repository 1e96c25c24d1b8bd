"""dscluster.files.paths finds entry_cn.sh, the presets and the venv in a checkout and in a
non-editable install (`pip install .`), whose wheel ships them as data files; entry_cn.sh of an
installed copy runs that copy's python; the hashed lock file pins what requirements.txt pins."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

import dscluster
from _install import build_wheel, installed_venv, new_venv, site_packages
from dscluster.files import paths

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("from dscluster.files import paths; print(paths.checkout_root()); print(paths.entry_script()); "
         "print(paths.preset('digits')); print(paths.venv_dir())")
# Where the user's program says it runs from: the interpreter's prefix and the dscluster it imports.
WHO_AM_I = "import sys, dscluster; print('prefix', sys.prefix); print('package', dscluster.__file__)"


def bare_env(tmp_path: Path) -> dict[str, str]:
    """A rank's environment with no venv on PATH, outside any job and any checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_COMM_WORLD_RANK", "RANK", "DSCLUSTER_RUN_ID", "DSCLUSTER_VENV", "VIRTUAL_ENV",
                        "PYTHONPATH", "PYTHONHOME")}
    return {**env, "PATH": "/usr/bin:/bin", "DSCLUSTER_RUNS": str(tmp_path / "runs")}


def test_in_the_checkout_everything_is_at_its_root():
    assert paths.checkout_root() == ROOT and paths.assets_root() == ROOT
    assert paths.entry_script() == ROOT / "entry_cn.sh" and os.access(paths.entry_script(), os.X_OK)
    assert paths.preset("digits") == paths.preset("configs/digits.yaml") == ROOT / "configs" / "digits.yaml"
    assert paths.preset("digits").is_file()
    if (ROOT / ".venv" / "bin" / "python").exists():
        assert paths.venv_bin() == ROOT / ".venv" / "bin"


def test_a_relative_config_missing_here_names_the_shipped_preset_and_a_local_file_wins(tmp_path, monkeypatch):
    """Ranks and `dscluster plan` start in the launch directory, not in the repository."""
    from dscluster.core.config import load_config

    monkeypatch.chdir(tmp_path)
    assert paths.config_path("configs/vit_base.yaml") == ROOT / "configs" / "vit_base.yaml"
    assert load_config("configs/vit_base.yaml").model.name == "vit_base_patch16_224"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "vit_base.yaml").write_text("epochs: 1\n")
    assert paths.config_path("configs/vit_base.yaml") == Path("configs/vit_base.yaml")
    assert load_config("configs/vit_base.yaml").epochs == 1
    assert paths.config_path("configs/none.yaml") == Path("configs/none.yaml")  # load_config: "no such config"


def test_an_installed_layout_is_found_and_its_entry_script_runs_that_prefixs_python(tmp_path):
    # The layout `pip install .` makes, without building a wheel: the package in site-packages,
    # entry_cn.sh and the presets in <prefix>/share/dscluster.
    venv = new_venv(tmp_path / "venv")
    shutil.copytree(ROOT / "src" / "dscluster", site_packages(venv) / "dscluster",
                    ignore=shutil.ignore_patterns("__pycache__"))
    share = venv / "share" / "dscluster"
    shutil.copytree(ROOT / "configs", share / "configs")
    shutil.copy2(ROOT / "entry_cn.sh", share / "entry_cn.sh")
    script = venv / "bin" / "dscluster"  # the console script pip writes
    script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom dscluster.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    env = bare_env(tmp_path)

    out = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", str(share / "entry_cn.sh"), str(share / "configs" / "digits.yaml"),
                                  str(venv)]
    # No venv on PATH: entry_cn.sh must still run the user's `python` as the prefix's python, which
    # imports the installed package, not the checkout's.
    res = subprocess.run([str(share / "entry_cn.sh"), "python", "-c", WHO_AM_I], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert f"prefix {venv}\n" in res.stdout, res.stdout
    assert f"package {site_packages(venv) / 'dscluster' / '__init__.py'}\n" in res.stdout


def test_entry_script_without_any_dscluster_says_where_it_looked(tmp_path):
    share = tmp_path / "prefix" / "share" / "dscluster"
    share.mkdir(parents=True)
    shutil.copy2(ROOT / "entry_cn.sh", share / "entry_cn.sh")
    res = subprocess.run([str(share / "entry_cn.sh")], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env=bare_env(tmp_path))
    assert res.returncode == 2
    assert "no dscluster command" in res.stderr and "DSCLUSTER_VENV" in res.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building the wheel needs setuptools>=77 (PEP 639 licence fields); {setuptools.__version__} here")
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.mark.slow
def test_wheel_ships_entry_script_presets_licence_and_one_version(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = {i.filename: i for i in z.infolist()}
        data = f"dscluster-{dscluster.__version__}.data/data/share/dscluster/"
        entry = names[data + "entry_cn.sh"]
        assert (entry.external_attr >> 16) & 0o111, "entry_cn.sh lost its executable bit"
        presets = {n.rsplit("/", 1)[1] for n in names if n.startswith(data + "configs/")}
        assert presets == {p.name for p in (ROOT / "configs").glob("*.yaml")}
        assert data + "setup/hello_mpi.py" in names  # check's MPI hello-world across the nodes
        meta = z.read(f"dscluster-{dscluster.__version__}.dist-info/METADATA").decode()
    assert f"Version: {dscluster.__version__}\n" in meta and "License-Expression: MIT" in meta
    assert 'Requires-Dist: deepspeed; extra == "train"' in meta and "Requires-Dist: paramiko" in meta
    assert "Requires-Dist: shtab" in meta  # `dscluster completion` is part of the base install


@pytest.mark.slow
def test_installed_copy_finds_its_files_outside_any_checkout(wheel, tmp_path):
    venv = installed_venv(tmp_path / "venv", wheel)
    env = bare_env(tmp_path)
    out = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE + "; import sys; print(sys.path)"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    share = venv / "share" / "dscluster"
    lines = out.stdout.splitlines()
    assert lines[:4] == ["None", str(share / "entry_cn.sh"), str(share / "configs" / "digits.yaml"), str(venv)]
    assert str(ROOT / "src") not in lines[4], "the checkout's src/ is on the installed copy's path"
    # entry_cn.sh runs from there: the user's program gets a run directory and the installed python
    res = subprocess.run([str(share / "entry_cn.sh"), "python", "-c",
                          "import os; print('rundir', os.environ['DSCLUSTER_RUN_DIR']); " + WHO_AM_I],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert f"rundir {tmp_path / 'runs'}" in res.stdout and f"prefix {venv}\n" in res.stdout


def _pins(text: str) -> dict[str, str]:
    return {m[0].lower().replace("_", "-"): m[1] for m in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M)}


def test_lock_file_pins_what_requirements_pins_and_hashes_every_package():
    wanted = _pins((ROOT / "requirements.txt").read_text())
    lock_text = (ROOT / "requirements.lock").read_text()
    locked = _pins(lock_text)
    stale = {name: (version, locked.get(name)) for name, version in wanted.items() if locked.get(name) != version}
    assert not stale, (f"requirements.lock disagrees with requirements.txt {stale}: run the pip-compile "
                       "command in the lock file's header again")
    # pip install --require-hashes refuses a lock file with any unhashed entry
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock_text)
    unhashed = [e.split("==")[0] for e in entries if "==" in e and "--hash=sha256:" not in e]
    assert not unhashed and len(locked) > len(wanted)
