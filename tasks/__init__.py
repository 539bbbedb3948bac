"""The deploy's steps, one concern per module, each a pyinfra deploy (`apply`): deploy.py
calls them in build order."""
