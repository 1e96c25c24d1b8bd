"""Where dscluster's own files are: in a checkout, or in an installed copy (`pip install .`).

A checkout (src layout) has entry_cn.sh, configs/ and .venv at its root, two folders above this
package. An installed copy has no root: pyproject.toml ships entry_cn.sh and configs/*.yaml as
data files into `<prefix>/share/dscluster/`, in the checkout's layout, so that entry_cn.sh (which
finds the presets beside itself) works from there unchanged. Every lookup goes through here.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from dscluster.errors import UsageError

ENTRY_SCRIPT = "entry_cn.sh"
CONFIGS_DIR = "configs"
SHARE_DIR = Path("share") / "dscluster"
"""Where pyproject.toml's data files land, below the install scheme's data path."""


def checkout_root() -> Path | None:
    """The checkout this package runs from (an editable install or PYTHONPATH=src), else None."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() and (root / ENTRY_SCRIPT).is_file() else None


def installed_root() -> Path | None:
    """`<prefix>/share/dscluster` of an installed copy (venv, --user or system scheme), else None."""
    candidates = [Path(sysconfig.get_path("data")) / SHARE_DIR, Path(sys.prefix) / SHARE_DIR]
    return next((c for c in candidates if (c / ENTRY_SCRIPT).is_file()), None)


def assets_root() -> Path:
    """The folder holding entry_cn.sh and configs/: the checkout's root, else the installed copy's."""
    root = checkout_root() or installed_root()
    if root is None:
        raise UsageError(f"cannot find {ENTRY_SCRIPT}: neither a checkout around {Path(__file__).parent} nor "
                         f"{Path(sysconfig.get_path('data')) / SHARE_DIR} (reinstall dscluster with pip)")
    return root


def entry_script() -> Path:
    """What every rank runs (launchers start it by this absolute path on every node)."""
    return assets_root() / ENTRY_SCRIPT


def preset(name: str) -> Path:
    """A training preset by name (`digits`) or relative path (`configs/digits.yaml`)."""
    rel = Path(name if name.endswith(".yaml") else f"{CONFIGS_DIR}/{name}.yaml")
    return assets_root() / (rel if rel.parts[0] == CONFIGS_DIR else Path(CONFIGS_DIR) / rel)


def config_path(text: str) -> Path:
    """What `--config TEXT` names: the file TEXT where it exists or is absolute, else a relative TEXT
    that names a file of the checkout or the installed copy (`configs/vit_base.yaml`): ranks and
    `dscluster plan` run wherever they were started, not in the repository."""
    here = Path(text)
    if here.exists() or here.is_absolute():
        return here
    try:
        shipped = assets_root() / here
    except UsageError:
        return here
    return shipped if shipped.is_file() else here


def venv_dir() -> Path:
    """The environment dscluster runs in: a checkout's .venv when it has one (the path entry_cn.sh
    uses on every node), else the running interpreter's prefix."""
    root = checkout_root()
    if root is not None and (root / ".venv" / "bin" / "python").exists():
        return root / ".venv"
    return Path(sys.prefix)


def venv_bin() -> Path:
    return venv_dir() / "bin"
