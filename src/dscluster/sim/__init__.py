"""The simulated lab: N "machines" on one Linux host, for tests and the demo (root only)."""
