"""Pairwise link tests between every two nodes: what the data connections of a run will meet.

NCCL and gloo connect to *ephemeral* ports, send full-size frames, run at the slowest cable's pace
and leave by the NIC the routing table picks. So for each ordered pair (A, B): **ports** (A connects
to TCP ports B's kernel picked), **mtu** (one do-not-fragment UDP datagram of A's MTU, answered by
B), **speed** (A sends TCP briefly, B returns the byte count) and **nic** (A's per-interface
tx_bytes around that send: the bytes must leave by the chosen interface). Each node runs one small
server; the pairs run in rounds (in round r node i sends to node i+r) so each node receives from
one peer at a time. The scripts are plain Python (no torch); the findings are check.netrules'.
"""

from __future__ import annotations

import json
import shlex

from dscluster.ssh import remote

SERVER_PORTS = 4         # ephemeral TCP ports each node opens (NCCL opens a few per peer too)
CONNECT_TIMEOUT_S = 2.0
SPEED_SECONDS = 0.4
UDP_HEADERS = 28         # IPv4 (20) + UDP (8): an MTU of 1500 carries 1472 bytes of payload
IP_MTU_DISCOVER, IP_PMTUDISC_DO = 10, 2   # <linux/in.h>; Python's socket module lacks them before 3.12

SERVER_CODE = r"""
import json, os, socket, sys, threading, time
addr, seconds, nports = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
def thread(fn, *a):
    threading.Thread(target=fn, args=a, daemon=True).start()
def sink(c):
    n = 0
    c.settimeout(seconds)
    try:
        while True:
            b = c.recv(1 << 20)
            if not b:
                break
            n += len(b)
        c.sendall(str(n).encode())
    except OSError:
        pass
    c.close()
def serve(s):
    while True:
        c, _ = s.accept()
        thread(sink, c)
def echo(u):
    while True:
        data, peer = u.recvfrom(65535)
        u.sendto(str(len(data)).encode(), peer)
tcp = []
for _ in range(nports):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 0)); s.listen(64); tcp.append(s); thread(serve, s)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((addr, 0)); thread(echo, u)
print("LISTENING " + json.dumps({"tcp": [s.getsockname()[1] for s in tcp], "udp": u.getsockname()[1]}), flush=True)
thread(lambda: (sys.stdin.read(), os._exit(0)))
time.sleep(seconds)
os._exit(0)
"""

CLIENT_CODE = r"""
import json, os, socket, sys, threading, time
peer, addr, tcp = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
udp, mtu, timeout, secs = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])
out = {"peer": peer, "ports": {}, "mtu": {}, "speed": None}
def tryport(p):
    try:
        socket.create_connection((addr, p), timeout=timeout).close(); out["ports"][str(p)] = "ok"
    except Exception as e:
        out["ports"][str(p)] = "%s: %s" % (type(e).__name__, e)
ts = [threading.Thread(target=tryport, args=(p,)) for p in tcp]
[t.start() for t in ts]; [t.join() for t in ts]
def df(size):
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.setsockopt(socket.IPPROTO_IP, @DISCOVER@, @DO@); u.settimeout(0.7)
    for _ in range(3):
        try:
            u.sendto(b"x" * size, (addr, udp)); data = u.recv(64)
            return "ok" if int(data) == size else "short: %s of %d bytes" % (data.decode(), size)
        except socket.timeout:
            continue
        except OSError as e:
            return "%s: %s" % (type(e).__name__, e)
    return "no answer"
out["mtu"] = {"size": mtu - @HEADERS@, "large": df(mtu - @HEADERS@), "small": df(64)}
def counters():
    d = {}
    for i in os.listdir("/sys/class/net"):
        try:
            d[i] = int(open("/sys/class/net/%s/statistics/tx_bytes" % i).read())
        except (OSError, ValueError):
            pass
    return d
port = next((int(p) for p, v in out["ports"].items() if v == "ok"), None)
if port is not None:
    try:
        before = counters(); s = socket.create_connection((addr, port), timeout=timeout); s.settimeout(10)
        chunk = b"\0" * (1 << 20); t0 = time.monotonic(); sent = 0
        while time.monotonic() - t0 < secs:
            s.sendall(chunk); sent += len(chunk)
        s.shutdown(socket.SHUT_WR); got = int(s.recv(64) or 0); dt = time.monotonic() - t0; s.close()
        after = counters()
        out["speed"] = {"bytes": got, "seconds": round(dt, 4), "bps": int(got * 8 / dt),
                        "tx": {i: after[i] - before.get(i, 0) for i in after if after[i] - before.get(i, 0) > 0}}
    except Exception as e:
        out["speed"] = {"error": "%s: %s" % (type(e).__name__, e)}
try:
    import subprocess
    route = subprocess.run(["ip", "-o", "route", "get", addr], capture_output=True, text=True, timeout=5)
    out["route"] = route.stdout.strip()
except Exception:
    out["route"] = None
print("LINK " + json.dumps(out), flush=True)
""".replace("@DISCOVER@", str(IP_MTU_DISCOVER)).replace("@DO@", str(IP_PMTUDISC_DO)).replace(
    "@HEADERS@", str(UDP_HEADERS))


def server_command(python: str, addr: str, seconds: float, nports: int = SERVER_PORTS) -> str:
    q = shlex.quote
    return f"{q(python)} -c {q(SERVER_CODE)} {q(addr)} {seconds:.0f} {nports}"


def client_command(python: str, peer: str, addr: str, ports: dict, mtu: int, *,
                   timeout: float = CONNECT_TIMEOUT_S, seconds: float = SPEED_SECONDS) -> str:
    q = shlex.quote
    return (f"{q(python)} -c {q(CLIENT_CODE)} {q(peer)} {q(addr)} {q(json.dumps(ports['tcp']))} "
            f"{int(ports['udp'])} {int(mtu)} {timeout} {seconds}")


def parse_server_ready(line: str) -> dict | None:
    """The server's first line: 'LISTENING {"tcp": [...], "udp": N}'."""
    if not line.startswith("LISTENING "):
        return None
    try:
        doc = json.loads(line[len("LISTENING "):])
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc.get("tcp"), list) and isinstance(doc.get("udp"), int) else None


def parse_client(text: str) -> dict | None:
    for line in text.splitlines():
        if line.startswith("LINK "):
            try:
                return json.loads(line[len("LINK "):])
            except json.JSONDecodeError:
                return None
    return None


def rounds(names: list[str]) -> list[list[tuple[str, str]]]:
    """Ordered pairs in rounds: in round r node i sends to node i+r, so every node sends to one
    peer and receives from one peer per round, and every ordered pair comes up once."""
    n = len(names)
    return [[(names[i], names[(i + r) % n]) for i in range(n)] for r in range(1, n)]


def run_pairs(sessions: dict, python: str, address: dict[str, str], mtu: dict[str, int],
              timeout: float, start_server, show_progress: bool = False) -> tuple[list[dict], dict[str, str]]:
    """Servers on every node, then the rounds. Returns (one record per ordered pair that ran,
    node -> why its server did not start). `start_server(client, command, seconds)` returns
    (channel, first line) or (None, reason) (check.probe.start_ready)."""
    names = [n for n in address if n in sessions]
    servers = {}
    ready = {}
    failed = {}
    seconds = max(30.0, timeout * (len(names) + 1))
    for name in names:
        chan, line = start_server(sessions[name], server_command(python, address[name], seconds), seconds)
        ports = parse_server_ready(line or "") if chan is not None else None
        if ports is None:
            failed[name] = line or "no answer"
            if chan is not None:
                chan.close()
            continue
        servers[name], ready[name] = chan, ports
    records: list[dict] = []
    try:
        for pairs in rounds([n for n in names if n in ready]):
            by_sender = dict(pairs)

            def work(t: remote.Target) -> dict | None:
                peer = by_sender[t.name]  # noqa: B023 (fan_out returns before the next round rebinds it)
                cmd = client_command(python, peer, address[peer], ready[peer], mtu.get(t.name) or 1500)
                return parse_client(remote.run(sessions[t.name], cmd, timeout=timeout).stdout)

            outcomes = remote.fan_out([remote.Target(name=a, host=a) for a in by_sender], work, timeout=timeout + 5,
                                      description="link tests", show_progress=show_progress)
            for sender, o in outcomes.items():
                rec = o.value if o.ok and o.value else {"peer": by_sender[sender], "error": str(o.error or "no result")}
                records.append({"from": sender, "to": rec.pop("peer"), **rec})
    finally:
        for chan in servers.values():
            chan.close()
    return records, failed
