"""uncloseai donor provisioning: the inventory, rendering, rollout, acceptance and status code."""

__version__ = "0.19.1"
