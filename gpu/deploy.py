"""The part of the deploy that the GPU box proves: the service user and our directories, then
exllamav3 from the wheel cache or a build, and the plugin (the driver, CUDA toolkit and torch are
the image's).

Usage (on that box, from the repo root): pyinfra -y gpu/inventory.py gpu/deploy.py
"""

from pyinfra import local

local.include("tasks/service_user.py")
local.include("tasks/exllamav3.py")
local.include("tasks/plugin.py")
