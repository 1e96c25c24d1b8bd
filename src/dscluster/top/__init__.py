"""`dscluster top`: every node's GPUs and the running job's ranks, live, watched or once."""
