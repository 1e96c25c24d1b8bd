"""`dscluster check`: what every node is (probe, facts), the rules, the active tests, check.json."""
