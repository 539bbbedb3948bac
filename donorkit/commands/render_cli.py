"""`donors render HOST OUT` (`make render HOST=<donor or edge> OUT=<dir>`): every file the
deploy would write to that host, laid out under OUT as on the box, by the deploy's own
rendering code (donorkit.render.templates).
OUT must not exist: it is made here, private (0700), and nothing is written through an existing
path (keys included)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from donorkit.inventory.fleet import FleetError, load_inventory
from donorkit.inventory.host_data import EdgeBox
from donorkit.inventory.paths import donors_file, pki_dir
from donorkit.inventory.pki import Pki, PkiError
from donorkit.render.canary_files import render_canary
from donorkit.render.templates import OutExists, render_host, write_tree


def run(host: str, out: Path) -> int:
    """The files of `host` written under `out`, their paths printed; DonorsError (one line) on
    a bad inventory, an unknown host or an existing OUT."""
    # A preview: a model not pinned yet renders without --revision (the deploy refuses it).
    fleet, edges = load_inventory(require_local_sources=False)
    for directory in sorted({pki_dir(data) for data in [*fleet.values(), *edges.values()]}):
        Pki(directory).check()
    hosts = {**fleet, **edges}
    if host not in hosts:
        raise FleetError(f"{donors_file()}: no donor or edge named '{host}' "
                         f"(known: {', '.join(sorted(hosts))})")
    files = render_host(hosts[host])
    if isinstance(hosts[host], EdgeBox):      # and its canary's (tasks/canary.py)
        files += render_canary(hosts[host])
    try:
        written = write_tree(files, out)
    except OSError as exc:
        raise OutExists(str(exc)) from None
    for path in written:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("host", help="donor or edge name (a key of donors.yml `donors:` or "
                                     "`edges:`)")
    parser.add_argument("out", type=Path, help="directory to lay the files out under")
    args = parser.parse_args(argv)
    try:
        return run(args.host, args.out)
    except FleetError as exc:
        print(f"inventory error: {exc}", file=sys.stderr)
    except PkiError as exc:
        print(f"pki error: {exc}", file=sys.stderr)
    except OutExists as exc:
        print(f"render: {exc}", file=sys.stderr)
    return 2

if __name__ == "__main__":
    sys.exit(main())
