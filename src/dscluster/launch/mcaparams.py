"""Where a hand-typed `mpirun` reads its network settings: OpenMPI's and PRRTE's parameter files.

`dscluster launch` pins mpirun to the cluster subnet on its command line; a hand-typed mpirun has no
such options and may try a decoy interface. So `dscluster check` writes the subnet into
~/.openmpi/mca-params.conf (btl_tcp, read by every rank) and ~/.prte/mca-params.conf (oob_tcp, read
by mpirun and its daemons): one line under a `MARK` line, replaced on the next check, every other
line kept. A user's own line for the same key wins, and check says so (docs/launchers.md)."""

from __future__ import annotations

import inspect
import json
import shlex

MARK = "# dscluster check: the cluster subnet (the next line is replaced on every check)"
PARAM_FILES = {".openmpi/mca-params.conf": "btl_tcp_if_include", ".prte/mca-params.conf": "oob_tcp_if_include"}


def set_marked_param(text: str, key: str, value: str, mark: str = MARK) -> tuple[str, str | None]:
    """(the file with our `key = value` line under a `mark` comment line, replacing the pair an
    earlier check wrote; the user's own line for `key` if one exists). OpenMPI's parameter files
    take comments on lines of their own only, so the mark is a line of its own."""
    lines, skip = [], False
    for line in text.splitlines():
        if line.strip() == mark:
            skip = True
            continue
        if not skip:
            lines.append(line)
        skip = False
    theirs = next((line.strip() for line in lines
                   if line.split("=", 1)[0].strip() == key and not line.lstrip().startswith("#")), None)
    lines += [mark, f"{key} = {value}"]
    return "\n".join(lines) + "\n", theirs


# Run on each node by the head's Python: set_marked_param itself, then an atomic write per file.
WRITER_CODE = f"from __future__ import annotations\nMARK = {MARK!r}\n" + inspect.getsource(set_marked_param) + r"""
import json, os, sys, tempfile
files, value, mark = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
out = {}
for rel, key in files.items():
    path = os.path.join(os.path.expanduser("~"), rel)
    try:
        text, theirs = set_marked_param(open(path).read() if os.path.exists(path) else "", key, value, mark)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".mca-params.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        out[rel] = {"ok": True, "theirs": theirs}
    except OSError as e:
        out[rel] = {"ok": False, "error": str(e)}
print("MCA " + json.dumps(out))
"""


def writer_command(python: str, cidr: str) -> str:
    q = shlex.quote
    return f"{q(python)} -c {q(WRITER_CODE)} {q(json.dumps(PARAM_FILES))} {q(cidr)} {q(MARK)}"


def parse_writer(text: str) -> dict | None:
    for line in text.splitlines():
        if line.startswith("MCA "):
            try:
                return json.loads(line[4:])
            except json.JSONDecodeError:
                return None
    return None
