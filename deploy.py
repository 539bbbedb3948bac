"""
Turn a bare Ubuntu 22.04/24.04 or Debian 12 box with an RTX 4090 or 3090 into an uncloseai
serving node, in the order the box is built; then the edges, the public front doors that proxy
each hostname to the donors routing it.

Usage: pyinfra inventory/gpus.py deploy.py [--limit HOST]
"""

from pyinfra import host, local, state

from pyinfra_snapshot import progress

# A long step (CUDA packages, the vLLM venv, the exllamav3 build, the weights) is named in the
# run every 30 s while it runs, and timed when it ends (pyinfra_snapshot/progress.py).
progress.register(state)

if "donors" in host.groups:
    # A card profile with `engine: cpu` (vLLM's CPU build: the testbed's real-engine host) has no
    # CUDA toolkit, exllamav3 or plugin.
    cuda_engine = host.data.card["engine"] == "cuda"

    local.include("tasks/preflight.py")
    if cuda_engine:
        local.include("tasks/cuda.py")
    local.include("tasks/build_tools.py")
    local.include("tasks/service_user.py")
    local.include("tasks/vllm_venv.py")
    if cuda_engine:
        local.include("tasks/exllamav3.py")
        local.include("tasks/plugin.py")
    local.include("tasks/weights.py")
    local.include("tasks/units.py")
    local.include("tasks/caddy_repository.py")
    local.include("tasks/caddy.py")
    local.include("tasks/record_version.py")

if "edges" in host.groups:
    local.include("tasks/caddy_repository.py")
    local.include("tasks/edge_caddy.py")
    local.include("tasks/record_version.py")
