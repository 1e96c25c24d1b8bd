"""`dscluster launch`: the launch plan and command builders, and running them."""
