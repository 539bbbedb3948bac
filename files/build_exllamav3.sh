#!/bin/sh
# Build the exllamav3 wheel from $SRC against $VENV's torch and install it, all or nothing:
# the stamp goes first and comes back last, so an interrupted build is retried by the next run.
# Inputs (environment): SRC VENV CUDA_HOME ARCH GIB_PER_JOB STAMP STACK_KEY.
set -eu
: "${SRC:?}" "${VENV:?}" "${CUDA_HOME:?}" "${ARCH:?}" "${GIB_PER_JOB:?}" "${STAMP:?}" "${STACK_KEY:?}"

# nvcc jobs take ~1-2 GiB each: bound MAX_JOBS by available memory as well as by cores.
avail_kib=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
jobs=$(awk -v kib="$avail_kib" -v per="$GIB_PER_JOB" -v cpus="$(nproc)" \
  'BEGIN { j = int(kib / (per * 1048576)); if (j > cpus) j = cpus; if (j < 1) j = 1; print j }')

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
rm -f "$STAMP"
cd "$SRC"
echo "building exllamav3 for arch $ARCH with MAX_JOBS=$jobs"
env PATH="$VENV/bin:$CUDA_HOME/bin:$CUDA_HOME/nvvm/bin:$PATH" CUDA_HOME="$CUDA_HOME" \
  TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$jobs" \
  "$VENV/bin/pip" wheel -q --no-build-isolation --no-deps --wheel-dir "$out" .
"$VENV/bin/pip" install -q --no-deps --force-reinstall "$out"/exllamav3-*.whl
printf '%s' "$STACK_KEY" > "$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
