#!/bin/sh
# Build the exllamav3 wheel for this box's stack and leave it, with its sha256 sidecar, in $OUT_DIR.
# Installs nothing: the deploy verifies the sidecar and installs the wheel in a separate step (the
# same step a cache hit uses), then copies it back to the operator's wheel cache.
#
# All or nothing: the wheel is built in a temporary directory and moved into $OUT_DIR only when
# complete; the sidecar is written last, so "wheel + matching sidecar" means a finished build. A
# failed or killed build leaves no wheel behind and the next run starts it again. A finished wheel
# already in $OUT_DIR (a run that died after the build) is reused, not rebuilt.
#
# Runs as root (the deploy's step): the operator's pinned ref, cloned into root's $SRC, built with
# the root-owned venv's pip; nothing here is the service user's or came from another box. The
# wheel leaves this box only if it is a cache builder (donorkit/box/wheel_cache.py).
#
# Inputs (environment): GIT_URL REF SRC VENV CUDA_HOME ARCH GIB_PER_JOB OUT_DIR WHEEL PATCHES
# (PATCHES: space-separated patch files applied with `git apply`, in order; may be empty).
set -eu
: "${GIT_URL:?}" "${REF:?}" "${SRC:?}" "${VENV:?}" "${CUDA_HOME:?}" "${ARCH:?}" \
  "${GIB_PER_JOB:?}" "${OUT_DIR:?}" "${WHEEL:?}"
PATCHES=${PATCHES:-}

mkdir -p "$OUT_DIR"
cd "$OUT_DIR"
if [ -f "$WHEEL" ] && [ -f "$WHEEL.sha256" ] && sha256sum -c --quiet "$WHEEL.sha256"; then
  echo "exllamav3: $OUT_DIR/$WHEEL is already built"
  exit 0
fi
rm -f "$WHEEL" "$WHEEL.sha256"

# A clean checkout of the pinned ref: cloned beside $SRC and moved in (no half clone), then reset
# and cleaned so neither an earlier build's files nor an earlier patch survive.
if ! git -C "$SRC" rev-parse -q --verify HEAD >/dev/null 2>&1; then
  rm -rf "$SRC" "$SRC.clone"
  git clone -q "$GIT_URL" "$SRC.clone"
  mv "$SRC.clone" "$SRC"
fi
git -C "$SRC" fetch -q --tags "$GIT_URL"
git -C "$SRC" checkout -q --force --detach "$REF"
git -C "$SRC" clean -q -fdx
for patch in $PATCHES; do
  git -C "$SRC" apply "$patch"
done

# nvcc jobs take ~1-2 GiB each: bound MAX_JOBS by available memory as well as by cores.
avail_kib=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
jobs=$(awk -v kib="$avail_kib" -v per="$GIB_PER_JOB" -v cpus="$(nproc)" \
  'BEGIN { j = int(kib / (per * 1048576)); if (j > cpus) j = cpus; if (j < 1) j = 1; print j }')

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "exllamav3: building $REF for arch $ARCH with MAX_JOBS=$jobs, CUDA_HOME=$CUDA_HOME"
cd "$SRC"
env PATH="$VENV/bin:$CUDA_HOME/bin:$CUDA_HOME/nvvm/bin:$PATH" CUDA_HOME="$CUDA_HOME" \
  TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$jobs" \
  "$VENV/bin/pip" wheel -q --no-build-isolation --no-deps --wheel-dir "$work" .
if [ ! -f "$work/$WHEEL" ]; then
  echo "exllamav3: the build made $(ls "$work"), expected $WHEEL" >&2
  exit 1
fi
cd "$work"
sha256sum "$WHEEL" > "$WHEEL.sha256"
mv "$WHEEL" "$OUT_DIR/$WHEEL.part"
mv "$OUT_DIR/$WHEEL.part" "$OUT_DIR/$WHEEL"
mv "$WHEEL.sha256" "$OUT_DIR/$WHEEL.sha256"
echo "exllamav3: built $OUT_DIR/$WHEEL"
