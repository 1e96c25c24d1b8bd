"""The repository's deepspeed/ folder holds assets only: it must never shadow the library."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_deepspeed_from_repo_root_gives_the_real_library():
    out = subprocess.run(
        [sys.executable, "-c",
         "import deepspeed, os; print(deepspeed.__version__); print(os.path.dirname(deepspeed.__file__))"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    version, location = out.stdout.strip().splitlines()[-2:]
    assert "site-packages" in location, location
    assert not (ROOT / "deepspeed" / "__init__.py").exists()
    pins = (ROOT / "requirements.txt").read_text().splitlines()
    expected = [line.split("==")[1] for line in pins if line.startswith("deepspeed==")][0]
    assert version == expected


def test_readme_stays_within_its_300_lines():
    # The README keeps the pitch, the quick start and one table of results; the rest lives under docs/.
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300): move detail to docs/"
