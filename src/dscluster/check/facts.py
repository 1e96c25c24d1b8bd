"""What a node is, parsed from the text the probe printed on it. Pure code, no I/O.

The probe (dscluster.check.probe) prints sections, each `@@dscluster-section NAME`, the command's
output, then `@@dscluster-rc NAME RC`. Parsing lives here, apart from the SSH plumbing, so every
format is tested on recorded real output (tests/data/facts/). A missing tool (rc 127) or a failing
one is a fact in `NodeFacts.missing` / `NodeFacts.problems`, never an exception: one odd node must
not stop the check of the others.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from dscluster.node.gpus import visible_indices
from dscluster.node.netif import Interface, merge_interfaces, parse_ip_addr, parse_ip_link

SECTION_MARK = "@@dscluster-section"
RC_MARK = "@@dscluster-rc"

# Compute capability by marketing name, for drivers too old to answer `compute_cap`
# (nvidia-smi added the field in driver 510). Source: developer.nvidia.com/cuda-gpus.
_CC_BY_NAME = [
    (r"\bH200\b|\bH100\b|\bGH200\b", "9.0"),
    (r"\bB200\b|\bB100\b|\bGB200\b", "10.0"),
    (r"RTX 50\d0|RTX PRO 6000 Blackwell", "12.0"),
    (r"RTX 40\d0|\bL40S?\b|\bL4\b|RTX 6000 Ada", "8.9"),
    (r"\bA100\b|\bA30\b", "8.0"),
    (r"RTX 30\d0|\bA40\b|\bA10G?\b|RTX A\d000", "8.6"),
    (r"RTX 20\d0|\bT4\b|Quadro RTX|GTX 16\d0|TITAN RTX", "7.5"),
    (r"\bV100\b|TITAN V", "7.0"),
    (r"\bP100\b", "6.0"),
    (r"GTX 10\d0|TITAN X[p ]|\bP40\b|\bP4\b|Quadro P", "6.1"),
    (r"GTX 9\d0|TITAN X\b|\bM40\b|\bM60\b", "5.2"),
]


@dataclass
class Section:
    rc: int | None
    text: str


@dataclass
class Gpu:
    index: int
    name: str
    uuid: str
    compute_capability: str | None   # "8.6"
    memory_total_mb: int | None
    driver: str | None
    ecc_uncorrected: int | None      # None: not supported / not reported ([N/A])

    @property
    def cc(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)

    @property
    def sm(self) -> str | None:
        """The torch arch-list name for this GPU (sm_86)."""
        return None if self.cc is None else f"sm_{self.cc[0]}{self.cc[1]}"


@dataclass
class Topology:
    """`nvidia-smi topo -m`, GPU-to-GPU cells only (NV#, PIX, PXB, PHB, NODE, SYS)."""

    gpus: list[str]
    links: dict[str, dict[str, str]]

    def pairs(self) -> list[tuple[str, str, str]]:
        out = []
        for i, a in enumerate(self.gpus):
            for b in self.gpus[i + 1:]:
                out.append((a, b, self.links.get(a, {}).get(b, "?")))
        return out

    def only_host_bridge(self) -> bool:
        """True when no GPU pair has a path better than the CPU/host bridge (SYS or PHB):
        NCCL's P2P transport then tends to hang or crawl, so we set NCCL_P2P_DISABLE=1."""
        pairs = self.pairs()
        return bool(pairs) and all(kind in ("SYS", "PHB") for _, _, kind in pairs)

    def nvlink(self) -> bool:
        return any(kind.startswith("NV") for _, _, kind in self.pairs())


@dataclass
class PythonFacts:
    executable: str | None = None
    python: str | None = None
    torch: str | None = None
    torch_cuda: str | None = None        # CUDA version torch was built with (None: CPU build)
    arch_list: list[str] = field(default_factory=list)
    cuda_available: bool | None = None
    nccl: str | None = None
    deepspeed: str | None = None
    mpi4py: str | None = None
    mpi_library: str | None = None
    ds_ops: dict | None = None
    """check/dsops.py's facts: DeepSpeed's prebuilt ops, ninja, nvcc, TORCH_CUDA_ARCH_LIST."""
    error: str | None = None


@dataclass
class NodeFacts:
    """Everything the rules look at for one node (hostfile name = `name`)."""

    name: str
    hostname: str | None = None
    interfaces: list[Interface] = field(default_factory=list)
    kernel: str | None = None
    os_name: str | None = None
    cpus: int | None = None
    mem_total_mb: int | None = None
    mem_available_mb: int | None = None
    shm_total_bytes: int | None = None
    disk_path: str | None = None
    disk_free_bytes: int | None = None
    remote_time: float | None = None
    clock_offset_s: float | None = None
    python: PythonFacts = field(default_factory=PythonFacts)
    gpus: list[Gpu] = field(default_factory=list)
    topology: Topology | None = None
    mpirun: str | None = None
    ssh_address: str | None = None
    missing: list[str] = field(default_factory=list)    # tools not installed (rc 127)
    problems: list[str] = field(default_factory=list)   # sections that failed otherwise

    def to_dict(self) -> dict:
        d = asdict(self)
        d["interfaces"] = [i.to_dict() for i in self.interfaces]
        return d


# ---------------------------------------------------------------------------- sections

def split_sections(text: str) -> dict[str, Section]:
    sections: dict[str, Section] = {}
    current: str | None = None
    buf: list[str] = []
    for line in text.splitlines():
        if line.startswith(SECTION_MARK + " "):
            current, buf = line.split(None, 1)[1].strip(), []
            continue
        if line.startswith(RC_MARK + " ") and current is not None:
            parts = line.split()
            rc = int(parts[2]) if len(parts) > 2 and parts[2].lstrip("-").isdigit() else None
            sections[current] = Section(rc, "\n".join(buf))
            current = None
            continue
        if current is not None:
            buf.append(line)
    if current is not None:  # cut off (timeout): keep what came
        sections[current] = Section(None, "\n".join(buf))
    return sections


# ---------------------------------------------------------------------------- formats

def parse_os_release(text: str) -> str | None:
    values = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            values[k.strip()] = v.strip().strip('"')
    return values.get("PRETTY_NAME") or values.get("NAME")


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in MiB."""
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+):\s+(\d+)\s*kB", line)
        if m:
            values[m.group(1)] = int(m.group(2)) // 1024
    return values.get("MemTotal"), values.get("MemAvailable")


def parse_df(text: str) -> tuple[int | None, int | None, str | None]:
    """`df -B1 PATH`: (size bytes, available bytes, mount point) of the last data line."""
    rows = [l.split() for l in text.splitlines() if l.strip() and not l.startswith("Filesystem")]
    for row in reversed(rows):
        nums = [c for c in row if c.isdigit()]
        if len(nums) >= 3 and len(row) >= 6:
            return int(row[1]), int(row[3]), row[5]
    return None, None, None


def parse_nvidia_smi_gpus(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=index,name,uuid,compute_cap,memory.total,driver_version,
    ecc.errors.uncorrected.volatile.total --format=csv,noheader` (7 columns), or the same
    without compute_cap (6 columns, drivers before 510: capability comes from the name)."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) not in (6, 7) or not cells[0].isdigit():
            continue
        if len(cells) == 7:
            index, name, uuid, cc, mem, driver, ecc = cells
        else:
            index, name, uuid, mem, driver, ecc = cells
            cc = ""
        capability = cc if re.fullmatch(r"\d+\.\d+", cc) else compute_capability_from_name(name)
        m = re.match(r"(\d+)\s*MiB", mem)
        gpus.append(Gpu(
            index=int(index), name=name, uuid=uuid, compute_capability=capability,
            memory_total_mb=int(m.group(1)) if m else None,
            driver=driver or None,
            ecc_uncorrected=int(ecc) if ecc.isdigit() else None,
        ))
    return gpus


def compute_capability_from_name(name: str) -> str | None:
    for pattern, cc in _CC_BY_NAME:
        if re.search(pattern, name):
            return cc
    return None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_topology(text: str) -> Topology | None:
    """`nvidia-smi topo -m`: header row of column names, then one row per GPU/NIC."""
    lines = [_ANSI.sub("", l).rstrip() for l in text.splitlines()]
    header = None
    for i, line in enumerate(lines):
        cols = line.split()
        if cols and cols[0].startswith("GPU") and re.fullmatch(r"GPU\d+", cols[0]) and "X" not in cols:
            header = (i, cols)
            break
    if header is None:
        return None
    start, cols = header
    gpu_cols = [c for c in cols if re.fullmatch(r"GPU\d+", c)]
    links: dict[str, dict[str, str]] = {}
    for line in lines[start + 1:]:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            if cells and cells[0].startswith("Legend"):
                break
            continue
        row = cells[0]
        links[row] = {col: cells[1 + j] for j, col in enumerate(gpu_cols) if 1 + j < len(cells)}
    return Topology(gpus=gpu_cols, links=links) if links else None


def parse_python_json(text: str) -> PythonFacts:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            known = {k: d.get(k) for k in PythonFacts.__dataclass_fields__ if k in d}
            known["arch_list"] = list(d.get("arch_list") or [])
            return PythonFacts(**known)
    tail = text.strip().splitlines()[-1:] or ["no output"]
    return PythonFacts(error=tail[0][:300])


def parse_mpirun_version(text: str) -> str | None:
    m = re.search(r"\(Open MPI\)\s*(\S+)|Open MPI\S*\s+v?(\d[\w.]*)|(MPICH|Intel\(R\) MPI)\D*(\d[\w.]*)", text)
    if not m:
        return None
    if m.group(1):
        return f"Open MPI {m.group(1)}"
    if m.group(2):
        return f"Open MPI {m.group(2)}"
    return f"{m.group(3)} {m.group(4)}"


# ---------------------------------------------------------------------------- assembly

def node_facts(name: str, text: str, *, clock_offset_s: float | None = None,
               ssh_address: str | None = None) -> NodeFacts:
    """Turn one node's probe output into NodeFacts."""
    s = split_sections(text)
    f = NodeFacts(name=name, clock_offset_s=clock_offset_s, ssh_address=ssh_address)

    def ok(key: str, tool: str | None = None) -> Section | None:
        section = s.get(key)
        if section is None:
            f.problems.append(f"{key}: no output (probe cut off?)")
            return None
        if section.rc == 127:
            if (tool or key) not in f.missing:
                f.missing.append(tool or key)
            return None
        if section.rc not in (0, None):
            first = (section.text.strip().splitlines() or [""])[0][:200]
            f.problems.append(f"{key}: exit {section.rc}: {first}")
            return None
        return section

    if sec := ok("hostname"):
        f.hostname = sec.text.strip().splitlines()[0].strip() if sec.text.strip() else None
    addr, link = ok("ip_addr", "ip"), ok("ip_link", "ip")
    f.interfaces = merge_interfaces(parse_ip_link(link.text) if link else [],
                                    parse_ip_addr(addr.text) if addr else [])
    if sec := ok("uname"):
        f.kernel = sec.text.strip() or None
    if sec := ok("os_release"):
        f.os_name = parse_os_release(sec.text)
    if (sec := ok("nproc")) and sec.text.strip().isdigit():
        f.cpus = int(sec.text.strip())
    if sec := ok("meminfo"):
        f.mem_total_mb, f.mem_available_mb = parse_meminfo(sec.text)
    if sec := ok("shm", "df"):
        f.shm_total_bytes = parse_df(sec.text)[0]
    if sec := ok("disk", "df"):
        _, f.disk_free_bytes, f.disk_path = parse_df(sec.text)
    if sec := ok("date"):
        try:
            f.remote_time = float(sec.text.strip().splitlines()[0])
        except (ValueError, IndexError):
            pass
    sec = s.get("python")
    if sec is not None and sec.rc == 127:
        f.missing.append("python")
        f.python = PythonFacts(error="python not found at the same path as on the head")
    elif sec is not None:
        f.python = parse_python_json(sec.text)
    if sec := ok("nvidia_smi", "nvidia-smi"):
        f.gpus = parse_nvidia_smi_gpus(sec.text)
        # nvidia-smi lists the whole machine; the node's jobs see only CUDA_VISIBLE_DEVICES
        # (a GPU lab node, or a workstation whose user gave the cluster two of its four GPUs).
        if f.gpus and (vis := s.get("cuda_visible")) is not None and vis.rc == 0:
            keep = visible_indices(vis.text.strip(), [g.uuid for g in f.gpus])
            f.gpus = [f.gpus[i] for i in keep]
    if f.gpus and (sec := s.get("nvidia_topo")) and sec.rc == 0:
        f.topology = parse_topology(sec.text)
    if sec := ok("mpirun"):
        f.mpirun = parse_mpirun_version(sec.text)
    return f


def clock_offset(remote_time: float, t_send: float, t_recv: float) -> float:
    """Remote clock minus ours, assuming the reply was stamped halfway through the round trip."""
    return remote_time - (t_send + t_recv) / 2
