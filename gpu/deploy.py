"""The part of the deploy that the GPU box proves: the service user and our directories, then
exllamav3 from the wheel cache or a build, and the plugin (the driver, CUDA toolkit and torch are
the image's).

Usage (on that box, from the repo root): pyinfra -y gpu/inventory.py gpu/deploy.py
"""

from tasks import exllamav3, plugin, service_user

service_user.apply()
exllamav3.apply()
plugin.apply()
