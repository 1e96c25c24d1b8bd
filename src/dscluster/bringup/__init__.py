"""`dscluster setup`: passwordless SSH between every pair of nodes, pinned host keys."""
