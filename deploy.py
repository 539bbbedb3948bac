"""
Turn a bare Ubuntu 22.04/24.04 or Debian 12 box with an RTX 4090 or 3090 into an uncloseai
serving node, in the order the box is built; then the edges, the public front doors that proxy
each hostname to the donors routing it. Each step is one module of tasks/ (a pyinfra deploy).

Usage: pyinfra inventory/gpus.py deploy.py [--limit HOST]
"""

from pyinfra import host, state

from pyinfra_declared import deploy_file, progress
from tasks import (
    build_tools,
    caddy,
    caddy_repository,
    canary,
    cuda,
    edge_caddy,
    exllamav3,
    plugin,
    preflight,
    record_version,
    service_user,
    tunnel,
    units,
    vllm_venv,
    weights,
)

# A long step (CUDA packages, the vLLM venv, the exllamav3 build, the weights) is named in the
# run every 30 s while it runs, and timed when it ends (pyinfra_declared/progress.py).
progress.register(state)
# This file known as a module file: pyinfra's stack walk, per operation, finds it at once
# (pyinfra_declared/deploy_file.py).
deploy_file.register(state)

if "tunnel_join" in host.groups:
    # A home donor's owner joins it to the tunnel, on the box (`make join`, inventory/join.py):
    # the tunnel only; the operator's deploy does the rest through it.
    tunnel.apply()

if "donors" in host.groups:
    # A home donor behind NAT (`reach: tunnel`) is deployed through its tunnel: kept first.
    if host.data.tunnel:
        tunnel.apply()
    # A card profile with `engine: cpu` (vLLM's CPU build: the testbed's real-engine host) has no
    # CUDA toolkit, exllamav3 or plugin.
    cuda_engine = host.data.card.engine == "cuda"

    preflight.apply()
    if cuda_engine:
        cuda.apply()
    build_tools.apply()
    service_user.apply()
    vllm_venv.apply()
    if cuda_engine:
        exllamav3.apply()
        plugin.apply()
    weights.apply()
    units.apply()
    caddy_repository.apply()
    caddy.apply()
    record_version.apply()

if "edges" in host.groups:
    caddy_repository.apply()
    edge_caddy.apply()
    # Every donor checked against its reference; one that fails is out of the pools.
    canary.apply()
    # The hub of the home donors among its upstreams, if any (after its Caddy: the first deploy
    # stops here, printing the edge's new tunnel key for the donors file).
    if host.data.tunnel:
        tunnel.apply()
    record_version.apply()
