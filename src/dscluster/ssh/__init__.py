"""SSH to the lab's nodes: Paramiko sessions and their fan-out, the project's pinned host keys,
the one "is this host this machine" rule, and file transfer over a session."""
