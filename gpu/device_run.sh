#!/bin/bash
# The whole GPU-box proof, one command (the `device` tool's H200: CUDA 13.0, torch 2.11.0+cu130,
# no network). Carry: .whl (pyinfra and its dependencies, pytest-testinfra; py3.12 wheels; in
# .whl/build, setuptools for pip's build isolation) and .gpu (gpu/exllamav3_source.py's
# repository); `bash gpu/carry.sh` builds both. Logs go to $OUT.
#   1. pyinfra from the carried wheels; a venv of our own with the image's torch linked in
#   2. bench/exllamav3_cache.py: cold build, kernel check, wiped box = second box of the stack
#      (cache hit, no compiler), converge, corrupt cache refused, cache hit again
#   3. the C++17/C++20 probe (does 1.5.1 need files/exllamav3-cxx20.patch on nvcc 13.0?)
#   4. the verification suite on the box (tests/verify --on-box)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/device.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# No network here: pip's build isolation (the plugin's editable install) takes setuptools from the
# carried wheels (.whl/build), as a donor would from PyPI.
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl/build
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
free -g | head -2; nproc

VENV=/opt/uncloseai/venv
python3 -m venv --without-pip "$VENV" || exit 1
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
image_site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
echo "$image_site" > "$site/image-torch.pth"  # torch's own dependencies (nvidia-*, ...)
# torch itself where pip would have put it: the deploy's facts read torch's version.py and its
# dist-info in the venv's site-packages, without starting Python.
ln -sfn "$image_site/torch" "$site/torch"
ln -sfn "$image_site"/torch-*.dist-info "$site/"
printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n' > "$VENV/bin/pip"
chmod 755 "$VENV/bin/pip"
ln -sf "$(command -v ninja || echo "$(dirname "$(command -v python3)")/ninja")" "$VENV/bin/ninja"
"$VENV/bin/python" -c 'import torch; print("venv torch", torch.__version__, torch.version.cuda)'
mkdir -p /srv/mirror && cp -r .gpu/exllamav3-src /srv/mirror/exllamav3
# The deploy checks the import as the service user; if the image's torch is not readable by other
# users there, say so and check as root instead (a donor's venv is ours and world-readable).
if ! runuser -u nobody -- env -i PATH=/usr/bin:/bin HOME=/tmp "$VENV/bin/python" -c 'import torch'
then
  echo "NOTE: the image's torch is not usable by other users: service_user root for this run"
  sed 's/^overrides:$/overrides:\n  service_user: root/' gpu/donors.yml > /tmp/donors.yml
  export DONORS_FILE=/tmp/donors.yml
fi

if [ "${BENCH:-1}" = 1 ]; then
  python3 bench/exllamav3_cache.py --inventory gpu/inventory.py --deploy gpu/deploy.py \
    --wipe-box "sh gpu/wipe_box.sh" --out "$OUT" \
    --after-cold "$VENV/bin/python gpu/kernel_check.py"
  echo "bench rc=$?"
  ls -la .wheel-cache/exllamav3/*/
  python3 gpu/cxx_probe.py .gpu/exllamav3-src /usr/local/cuda-13.0 9.0
else  # BENCH=0: one converge (for the verification suite), then the kernel check
  time python3 -m pyinfra -y gpu/inventory.py gpu/deploy.py > "$OUT/deploy.log" 2>&1
  echo "deploy rc=$?"; tail -40 "$OUT/deploy.log"
  "$VENV/bin/python" gpu/kernel_check.py
fi

if [ -d tests/verify ]; then
  timeout 90 python3 -m pytest tests/verify --on-box h200-lent --donors "${DONORS_FILE:-gpu/donors.yml}" -q \
    -p no:cacheprovider > "$OUT/verify.log" 2>&1
  echo "verify rc=$?"; tail -25 "$OUT/verify.log"
fi
