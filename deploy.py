"""
Turn a bare Ubuntu 22.04/24.04 or Debian 12 box with an RTX 4090 or 3090 into an uncloseai
serving node, in the order the box is built.

Usage: pyinfra inventory/gpus.py deploy.py [--limit HOST]
"""

from pyinfra import local

local.include("tasks/preflight.py")
local.include("tasks/cuda.py")
local.include("tasks/build_tools.py")
local.include("tasks/service_user.py")
local.include("tasks/vllm_venv.py")
local.include("tasks/exllamav3.py")
local.include("tasks/plugin.py")
local.include("tasks/weights.py")
local.include("tasks/units.py")
local.include("tasks/caddy.py")
