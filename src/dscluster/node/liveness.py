"""Noticing a node that vanished (power lost, cable pulled) and naming it.

Three places need the same facts, so they live here:
- OpenMPI 5's runtime (PRRTE) watches its remote daemons with TCP keepalives whose defaults let
  mpirun wait for a lost node until it comes back; `PRTE_KEEPALIVE` makes it give up after a
  short silence (docs/failure-behaviour.md). `dscluster setup` writes it into every node's
  ~/.prte/mca-params.conf, `dscluster launch` exports it; `lost_daemon_host` reads PRTE's message.
- A rank whose collective failed asks which peers still answer (`vanished_hosts`), so the run
  directory names the node that is gone, not only "a peer failed".
"""

from __future__ import annotations

import errno
import re
import socket
from concurrent.futures import ThreadPoolExecutor

# Idle seconds before the first probe, seconds between probes, probes missed before the
# daemon counts as lost: 10 + 3 × 5 = 25 s. Keepalives are answered by the kernel, so a
# busy node (CPU-bound ranks, a saturated link) still answers them.
PRTE_KEEPALIVE = {"oob_tcp_keepalive_time": "10", "oob_tcp_keepalive_intvl": "5", "oob_tcp_keepalive_probes": "3"}
KEEPALIVE_DETECT_S = 10 + 3 * 5

# OpenMPI 5 (PRRTE) and 4 (ORTE) print the same help text when a daemon stops answering.
_LOST_DAEMON = re.compile(r"Remote daemon\s*:\s*\S+\s+on node\s+(\S+)")
LOST_DAEMON_HEADLINE = "lost communication with a remote daemon"

# A connect that ends in one of these (or times out) found nobody at that address; "refused"
# means the machine is up and answered.
_GONE_ERRNOS = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT}
SSH_PORT = 22


def prte_env() -> dict[str, str]:
    """The keepalive settings as the environment variables mpirun reads (PRTE_MCA_<param>)."""
    return {f"PRTE_MCA_{k}": v for k, v in PRTE_KEEPALIVE.items()}


def prte_params_body() -> str:
    """The keepalive settings as lines of an MCA parameter file (~/.prte/mca-params.conf)."""
    lines = [f"# mpirun gives up on a node silent for {KEEPALIVE_DETECT_S} s (PRRTE's default: 8 minutes)"]
    return "\n".join(lines + [f"{k} = {v}" for k, v in PRTE_KEEPALIVE.items()]) + "\n"


def lost_daemon_host(line: str) -> str | None:
    """The node named by PRTE's "Remote daemon: [...] on node X" line, else None."""
    m = _LOST_DAEMON.search(line)
    return m.group(1) if m else None


def answers(host: str, port: int = SSH_PORT, timeout: float = 3.0) -> bool | None:
    """True when something at host answers a TCP connect (accepted or refused), False when
    nothing does (timeout, no route), None when the name does not resolve (cannot tell)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return True
    except socket.gaierror:
        return None
    except TimeoutError:
        return False
    except OSError as e:
        return False if e.errno in _GONE_ERRNOS else True
    except Exception:  # noqa: BLE001 - a failing rank asks this: it must never raise
        return None


def vanished_hosts(me: str, hosts: list[str], timeout: float = 3.0) -> list[str]:
    """The hosts of this job that no longer answer, probed from host `me` in parallel.

    When none of two or more peers answers, it is more likely this host that lost the network,
    so it names itself. Probes ssh's port: OpenMPI needs it on every node.
    """
    peers = sorted({h for h in hosts if h and h != me})
    if not peers:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:
        up = dict(zip(peers, pool.map(lambda h: answers(h, timeout=timeout), peers), strict=True))
    gone = [h for h in peers if up[h] is False]
    if len(peers) >= 2 and len(gone) == len(peers):
        return [me]
    return gone


def vanished_text(vanished: list[str], me: str) -> str:
    """What a failing rank on host `me` adds to its error about the hosts that did not answer."""
    if vanished == [me]:
        return f"; {me} reaches none of the other nodes: it lost the network itself"
    return f"; {', '.join(vanished)} did not answer from {me}" if vanished else ""
