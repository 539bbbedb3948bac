#!/bin/sh
# Median wall time of `pyinfra inventory.py deploy.py --dry` (200 operations, change detection
# only, on @local) with pyinfra 3.10 as released and with the diff applied, each from a copy of
# the venv's pyinfra under /tmp (nothing in the project is patched). Prints both and checks the
# detected operations come out in the same order.
#   usage: sh docs/proposals/op_order_bench/measure.sh [rounds]   (from the repository root)
set -eu
ROOT=$(pwd)
PY=$ROOT/.venv/bin/python
SITE=$($PY -c 'import pyinfra, os; print(os.path.dirname(os.path.dirname(pyinfra.__file__)))')
WORK=$(mktemp -d)
for kind in stock patched; do
  mkdir -p "$WORK/$kind" && cp -r "$SITE/pyinfra" "$WORK/$kind/"
done
(cd "$WORK/patched" && patch -s -p2 < "$ROOT/docs/proposals/pyinfra-op-order-from-frames.diff")
cd "$ROOT/docs/proposals/op_order_bench"
for kind in stock patched; do
  PYTHONPATH=$WORK/$kind $PY -m pyinfra inventory.py deploy.py --dry 2>&1 \
    | grep -o 'operation [0-9]*' > "$WORK/$kind.order"
  for round in $(seq "${1:-7}"); do
    start=$($PY -c 'import time; print(time.perf_counter())')
    PYTHONPATH=$WORK/$kind $PY -m pyinfra inventory.py deploy.py --dry > /dev/null 2>&1
    $PY -c "import time; print(round(time.perf_counter() - $start, 3))"
  done | sort -n | awk -v k="$kind" '{a[NR]=$1} END {print k, "median", a[int((NR+1)/2)], "s"}'
done
cmp -s "$WORK/stock.order" "$WORK/patched.order" && echo "same operation order" \
  || echo "ORDER DIFFERS"
rm -rf "$WORK"
