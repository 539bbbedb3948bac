"""The shared test helpers: what the unit tests, the testbed, bench/ and gpu/ import.

The testbed's hosts and what they are served (`make testbed`; tests/testbed/README.md):
- hosts: the test hosts' CLI (`python -m tests.support.hosts up|down|status`), `testbed()`, `ssh()`
- rootfs: the Debian 12 base root filesystem every host boots from (built once, cached)
- network: the bridge, one network namespace and veth per host, NAT out
- containers: one host = an overlay of the base rootfs booted by systemd-nspawn
- common: the testbed's paths, command running, phase timing, apt set-up, `make accept` as run
- www: the testbed's HTTP server (stand-in hub, CUDA repo, exllamav3 git repository)
- hub_standin: STAND-IN for the Hugging Face hub (also run as the HTTP server itself)
- cuda_standin: STAND-IN for NVIDIA's CUDA apt repository, built from NVIDIA's PyPI wheels
- cpu_engine: the real vLLM CPU engine's wheels for the real-engine host
- tiny_model: a tiny generated Qwen3 checkpoint (random weights) for the real engine
- rollout_watch: a request loop and the units' outages, to watch a rollout from outside
- deploy: `run_deploy()`, the one way a test or a benchmark runs pyinfra and reads its --json

Host-free helpers (`make test`):
- host_tools: what `make test` / `make testbed` need from this machine (caddy, systemd-analyze,
  nft), installed with `python -m tests.support.host_tools --install`
- make: a Makefile target as the unit tests run it
- host_edit: a frozen DonorBox or EdgeBox copied with one value changed
- rendered_shape: what a rendered Caddyfile and unit must be, read back by the real `caddy adapt`
- loopback_sshd: a real SSH server on 127.0.0.1 (paramiko)
- version_server: a stand-in donor Caddy (HTTPS, optional client CA) for `make accept`'s tests
- wheels: wheels and tar archives made for the cache tests
- gpu_image_dry_run: gpu/engine_run.py's steps run with only what the GPU image has (a script)

Modules here import each other by public names only (tests/unit/test_layout.py checks it).
"""
