#!/bin/sh
# Make the box look like a fresh box of the same stack: no exllamav3 in the venv, no build tree,
# no wheel, no stamp. The operator's wheel cache is left alone. Inputs: ROOT VENV (defaults: the
# device's).
ROOT=${ROOT:-/opt/uncloseai}
VENV=${VENV:-$ROOT/venv}
"$VENV/bin/pip" uninstall -q -y exllamav3 2>/dev/null || true
rm -rf "$ROOT/wheels" "$ROOT/src/exllamav3" "$ROOT/src/exllamav3.clone" \
  "$ROOT/state/exllamav3.stack"
