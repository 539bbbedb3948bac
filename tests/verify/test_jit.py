"""JIT preflight: what killed the seed's engine at warm-up (FlashInfer compiling fp8 kernels),
rehearsed as the service user with exactly the unit's environment, inside the unit's own sandbox
(a transient service with the unit's User= and confinement, read back from systemd)."""

from __future__ import annotations

import pytest
from boxcheck import (
    as_user,
    in_unit_sandbox,
    sm,
    systemd_booted,
    unit_env,
    unit_sandbox,
    user_home,
)
from testinfra.host import Host

from donorkit.inventory.host_data import DonorBox, ServedModel

KERNEL = r"""
#include <cuda_runtime.h>
__global__ void preflight(int *out) { *out = 42; }
int main() { int *d; cudaMalloc(&d, sizeof(int)); preflight<<<1, 1>>>(d); return 0; }
"""

# Like FlashInfer: nvcc from $CUDA_HOME, built by a bare `ninja` found on PATH, linked -lcudart.
SCRIPT = r"""
set -e
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/preflight.cu" <<'CU'
{kernel}
CU
cat > "$work/build.ninja" <<'NINJA'
rule nvcc
  command = $$CUDA_HOME/bin/nvcc -arch={arch} -o $out $in -lcudart
build preflight: nvcc preflight.cu
NINJA
test -n "$CUDA_HOME" || {{ echo "CUDA_HOME is not set"; exit 1; }}
echo "nvcc: $(command -v nvcc || echo 'nvcc: not found')"
echo "ninja: $(command -v ninja || echo 'ninja: not found')"
echo "cicc: $(command -v cicc || echo 'cicc: not found')"
cd "$work" && ninja
test -x "$work/preflight"
echo PREFLIGHT-OK
"""


def test_jit_compile_as_service_user(host: Host, data: DonorBox, m: ServedModel) -> None:
    env, source = unit_env(host, data, m)
    print(f"environment from {source}")
    user = data.service_user
    home = user_home(host, user)
    script = SCRIPT.format(kernel=KERNEL.strip(), arch=sm(data.card.arch))
    if systemd_booted(host):
        sandbox = unit_sandbox(host, m.unit)
        assert f"User={user}" in sandbox, f"{m.unit} does not run as {user}: {sandbox}"
        command, where = in_unit_sandbox(sandbox, env, script), f"the sandbox of {m.unit}"
    else:  # no systemd to confine it (the lent GPU box): the service user's plain shell
        command, where = as_user(user, home, env, script), f"a shell of {user}"
    result = host.run(command)
    assert result.rc == 0 and "PREFLIGHT-OK" in result.stdout, (
        f"nvcc -arch={sm(data.card.arch)} ... -lcudart in {where}, with the environment "
        f"of {source}, failed (rc {result.rc}):\n{result.stdout}\n{result.stderr}")


def test_service_user_home_writable(host: Host, data: DonorBox) -> None:
    """FlashInfer's JIT cache lives under the service user's home."""
    user = data.service_user
    home = user_home(host, user)
    result = host.run(f"runuser -u {user} -- test -d {home} -a -w {home}")
    if result.rc != 0:
        pytest.fail(f"{user}'s home {home} is missing or not writable by {user}", pytrace=False)
