"""The operator's commands: `donors` (cli.py) and what it runs (render, status, pin, accept,
rollout, join-file), and the transport to the boxes. May import every other wing."""
