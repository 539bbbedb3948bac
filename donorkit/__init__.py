"""uncloseai donor provisioning: the toolkit's own code (see README.md)."""

__version__ = "0.15.0"
