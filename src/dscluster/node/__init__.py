"""What dscluster knows of a node: the hostfile, network interfaces, CPUs, GPUs, rank detection
and whether a process is alive."""
