"""dscluster: a handful of lab GPU workstations as one DeepSpeed training cluster."""

__version__ = "0.1.0"  # the one version: pyproject.toml reads it (dynamic), `dscluster --version` prints it
