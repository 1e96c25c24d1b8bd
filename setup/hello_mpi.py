"""One line per MPI rank: rank, world size, host name. The first thing to run on a new cluster.

    mpirun -np 3 --hostfile hosts.txt .venv/bin/python setup/hello_mpi.py

If this prints one line per rank with the host names you expect, OpenMPI can start processes on
every node (node-to-node ssh, the same software path everywhere) and DeepSpeed can follow.
A barrier at the end proves the ranks can also talk to each other, not only start.
"""

import socket

from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    host = socket.gethostname()
    hosts = comm.gather(host, root=0)
    print(f"rank {rank} of {size} on {host}", flush=True)
    comm.Barrier()
    if rank == 0:
        print(f"all {size} ranks answered from {len(set(hosts))} hosts: {' '.join(sorted(set(hosts)))}", flush=True)


if __name__ == "__main__":
    main()
