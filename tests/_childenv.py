"""What a test does not pass on to a process it starts as a job of its own: the rank variables.

An in-process one-rank group (`dist.ensure_single_process_group`, for a DeepSpeed engine or loss scaler
in a test) sets RANK, LOCAL_RANK and WORLD_SIZE in the test process, and DeepSpeed reads them there
while the group lives, so they stay. A child that inherits RANK=0 takes rank 0 whatever its launcher
says: two ranks of one job both listened on MASTER_PORT (EADDRINUSE)."""

RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
