"""@local only: the measurement runs change detection (--dry) on this machine, nothing else."""

hosts = ["@local"]
