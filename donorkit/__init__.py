"""uncloseai donor provisioning: the inventory, rendering, rollout and acceptance code."""

__version__ = "0.15.0"
