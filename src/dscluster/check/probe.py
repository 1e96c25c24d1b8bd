"""What runs on each node: one probe script over SSH, plus the mesh and master-port tests.

One script per node rather than one SSH command per fact: a check must finish in seconds, and
every round trip and Python start (an `import torch` above all) multiplies by the node count, so
on nodes without a GPU the probe reads torch's version file instead of importing it. The script
is fed to `bash -s` on stdin, so it depends on the login shell only to start bash, and it runs the
head's interpreter path (`sys.executable`): launchers start ranks at that path, so that is the
Python whose versions matter.
"""

from __future__ import annotations

import inspect
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dscluster.check.dsops import ds_op_facts
from dscluster.check.facts import NodeFacts, clock_offset, node_facts
from dscluster.rundir.layout import runs_root
from dscluster.ssh import remote

GPU_QUERY = "index,name,uuid,compute_cap,memory.total,driver_version,ecc.errors.uncorrected.volatile.total"
GPU_QUERY_OLD = "index,name,uuid,memory.total,driver_version,ecc.errors.uncorrected.volatile.total"

# Printed as one JSON line by the node's Python. mpi4py is told not to initialise MPI:
# MPI_Init would start a singleton runtime, which is slow and not what we are asking.
PYTHON_FACTS = r"""
import json, sys, os
import importlib.metadata as md
import importlib.util
out = {"executable": sys.executable, "python": sys.version.split()[0]}
def version(name):
    try:
        return md.version(name)
    except Exception:
        return None
for name in ("torch", "deepspeed", "mpi4py"):
    out[name] = version(name)
try:
    import mpi4py
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    out["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
except Exception as e:
    out["mpi_library"] = None
gpu = len(sys.argv) > 1 and sys.argv[1] == "gpu"
try:
    if not gpu:
        # No GPU on this node: torch's version file says all that matters without the
        # seconds-long `import torch`; the bundled NCCL's version comes from its wheel.
        spec = importlib.util.find_spec("torch")
        if spec is None:
            raise ImportError("No module named 'torch'")
        ns = {}
        path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        exec(compile(open(path).read(), path, "exec"), ns)
        out["torch"], out["torch_cuda"] = ns.get("__version__"), ns.get("cuda")
        out["nccl"] = next((version(n) for n in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
                            if version(n)), None)
        out["arch_list"] = []
    else:
        import torch
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        arch = []
        try:
            arch = list(torch.cuda.get_arch_list())
            if not arch and torch.version.cuda:
                arch = [a for a in torch._C._cuda_getArchFlags().split() if a]
        except Exception:
            pass
        out["arch_list"] = arch
        out["cuda_available"] = bool(torch.cuda.is_available())
        try:
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:
            out["nccl"] = None
except Exception as e:
    out["error"] = "import torch failed: %s: %s" % (type(e).__name__, e)
try:
    out["ds_ops"] = ds_op_facts()
except Exception:
    out["ds_ops"] = None
print(json.dumps(out))
"""
# DeepSpeed's op facts: the function check/dsops.py owns, sent along as source (standard library only).
_DS_OPS_CALL = "\ntry:\n    out[\"ds_ops\"]"
PYTHON_FACTS = PYTHON_FACTS.replace(_DS_OPS_CALL, "\n" + inspect.getsource(ds_op_facts) + _DS_OPS_CALL, 1)


def probe_script(python: str, runs_dir: str) -> str:
    """The bash script every node runs. Each section prints its command's output and exit code;
    a missing tool shows up as exit 127, which facts.py records as a fact."""
    q = shlex.quote
    return f"""
PY={q(python)}
RUNS={q(runs_dir)}
sec() {{ local name=$1; shift; echo "@@dscluster-section $name"; "$@" 2>&1; echo "@@dscluster-rc $name $?"; }}
gpuq() {{
  command -v nvidia-smi >/dev/null 2>&1 || return 127
  nvidia-smi --query-gpu={GPU_QUERY} --format=csv,noheader 2>/dev/null \\
    || nvidia-smi --query-gpu={GPU_QUERY_OLD} --format=csv,noheader
}}
topo() {{ command -v nvidia-smi >/dev/null 2>&1 || return 127; nvidia-smi topo -m; }}
runsdf() {{ d=$RUNS; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; df -B1 "$d"; }}
pyfacts() {{
  [ -x "$PY" ] || {{ echo "$PY: not found"; return 127; }}
  kind=cpu; command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && kind=gpu
  "$PY" -c {q(PYTHON_FACTS)} $kind
}}
MPIRUN="$(dirname "$PY")/mpirun"; [ -x "$MPIRUN" ] || MPIRUN=mpirun
sec hostname hostname
sec ip_addr ip -o addr
sec ip_link ip -o link
sec uname uname -srm
sec os_release cat /etc/os-release
sec nproc nproc
sec meminfo head -n 3 /proc/meminfo
sec shm df -B1 /dev/shm
sec disk runsdf
sec date date +%s.%N
sec python pyfacts
sec nvidia_smi gpuq
sec cuda_visible printenv CUDA_VISIBLE_DEVICES
sec nvidia_topo topo
sec mpirun "$MPIRUN" --version
"""


@dataclass
class ProbeSettings:
    known_hosts: Path
    key_filename: str | None
    password: str | None
    timeout: float
    python: str = sys.executable
    runs_dir: str = ""


def default_key() -> str | None:
    """`dscluster setup` leaves the head's key at ~/.ssh/id_ed25519."""
    key = Path.home() / ".ssh" / "id_ed25519"
    return str(key) if key.exists() else None


def open_session(target: remote.Target, s: ProbeSettings):
    return remote.connect(target, known_hosts=s.known_hosts, password=s.password,
                          key_filename=s.key_filename, timeout=min(s.timeout, 10))


def probe_node(client, target: remote.Target, s: ProbeSettings) -> NodeFacts:
    """Clock first (a tiny command, so the round trip is short), then the probe script."""
    t_send = time.time()
    r = remote.run(client, "date +%s.%N", timeout=s.timeout)
    t_recv = time.time()
    offset = None
    try:
        offset = clock_offset(float(r.stdout.strip()), t_send, t_recv)
    except ValueError:
        pass
    r = remote.run(client, "bash -s", timeout=s.timeout, input=probe_script(s.python, s.runs_dir))
    peer = None
    try:
        peer = client.get_transport().getpeername()[0]
    except (OSError, AttributeError):
        pass
    return node_facts(target.name, r.stdout, clock_offset_s=offset, ssh_address=peer)


# ---------------------------------------------------------------------------- reachability

def reach_script(python: str, others: list[str], master_addr: str | None, master_port: int,
                 timeout: float) -> str:
    """From one node: BatchMode ssh to every other node (OpenMPI launches as a tree, so every
    node must reach every node without a password) and a TCP connect to the master port."""
    q = shlex.quote
    lines = [f"PY={q(python)}"]
    for h in others:
        lines.append(
            f"( err=$(ssh -n -o BatchMode=yes -o ConnectTimeout={int(max(2, timeout))} {q(h)} true 2>&1 >/dev/null); "
            f"rc=$?; echo \"MESH {h} $rc $(echo $err | tr '\\n' ' ' | cut -c1-200)\" ) &"
        )
    lines.append("wait")
    if master_addr:
        code = (
            "import socket,sys\n"
            "try:\n"
            f"    socket.create_connection(({master_addr!r}, {master_port}), timeout={max(2.0, timeout)}).close()\n"
            "    print('PORT ok')\n"
            "except Exception as e:\n"
            "    print('PORT fail', type(e).__name__, e)\n"
        )
        lines.append(f'"$PY" -c {q(code)}')
    return "\n".join(lines) + "\n"


@dataclass
class Reach:
    mesh: dict[str, tuple[bool, str]]   # other node -> (ok, reason)
    port_ok: bool | None
    port_error: str | None


def parse_reach(text: str) -> Reach:
    mesh: dict[str, tuple[bool, str]] = {}
    port_ok, port_error = None, None
    for line in text.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3 and parts[0] == "MESH":
            ok = parts[2] == "0"
            mesh[parts[1]] = (ok, "" if ok else (parts[3] if len(parts) > 3 else f"ssh exit {parts[2]}").strip())
        elif line.startswith("PORT ok"):
            port_ok = True
        elif line.startswith("PORT fail"):
            port_ok, port_error = False, line[len("PORT fail"):].strip()
    return Reach(mesh, port_ok, port_error)


def listener_code(addr: str, port: int, expected: int, seconds: float) -> str:
    """A throwaway master-port listener: exits after `expected` connections or `seconds`."""
    return (
        "import socket,sys,time\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "try:\n"
        f"    s.bind(({addr!r}, {port})); s.listen(64)\n"
        "except OSError as e:\n"
        "    print('BINDFAIL', e, flush=True); sys.exit(1)\n"
        "print('LISTENING', flush=True)\n"
        f"end=time.time()+{seconds}; n=0\n"
        f"while n < {expected} and time.time() < end:\n"
        "    s.settimeout(max(0.1, end-time.time()))\n"
        "    try:\n"
        "        c,_=s.accept(); c.close(); n+=1\n"
        "    except socket.timeout:\n"
        "        break\n"
    )


def start_listener(client, python: str, addr: str, port: int, expected: int, seconds: float):
    """Start the listener over an open session; returns (channel, None) or (None, reason)."""
    code = listener_code(addr, port, expected, seconds)
    chan, line = start_ready(client, f"{shlex.quote(python)} -c {shlex.quote(code)}", seconds)
    if chan is not None:
        return chan, None
    return None, line.replace("BINDFAIL", "").strip() or "listener did not start"


def start_ready(client, command: str, seconds: float):
    """Start a server over an open session and wait for its line starting with LISTENING:
    (channel, that line), or (None, why it did not come) once it failed or 15 s passed."""
    chan = client.get_transport().open_session(timeout=seconds)
    chan.exec_command(command)
    buf = b""
    deadline = time.monotonic() + min(seconds, 15)
    chan.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            data = chan.recv(4096)
        except Exception:  # noqa: BLE001 - socket.timeout between polls
            data = None
        if data == b"":
            break
        if data:
            buf += data
            for line in buf.decode("utf-8", "replace").splitlines(keepends=True):
                if line.startswith("LISTENING") and line.endswith("\n"):
                    return chan, line.strip()
            if b"BINDFAIL" in buf:
                break
    reason = buf.decode("utf-8", "replace").strip()
    if not reason:
        err = b""
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(4096)
        reason = err.decode("utf-8", "replace").strip()[-300:] or "server did not start"
    chan.close()
    return None, reason


def runs_dir_for_probe() -> str:
    """Absolute path of where runs are written (ranks run in the head's cwd on every node)."""
    return os.path.abspath(runs_root())
