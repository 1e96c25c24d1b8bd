"""The repository's deepspeed/ folder holds assets only: it must never shadow the library."""

import re
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


def test_readme_and_contributing_stay_short_enough_to_scan():
    # A newcomer scans the README in two minutes and CONTRIBUTING.md in five; detail lives under docs/.
    for name in ("README.md", "CONTRIBUTING.md"):
        lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
        assert len(lines) <= 200, f"{name} has {len(lines)} lines (at most 200): move detail to docs/"
        wide = [number for number, line in enumerate(lines, 1) if len(line) > 300]
        assert not wide, f"{name}: lines {wide} are over 300 characters: split the sentence or move it to docs/"


def test_every_relative_link_of_the_readme_and_docs_names_a_file_that_exists():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, f"links to files that do not exist: {missing}"
