"""`make render HOST=<donor or edge> OUT=<dir>`: every file the deploy would write to that host,
laid out under OUT as on the box. Uses the deploy's own rendering code (donorkit.render).
OUT must not exist: it is made here, private (0700), and nothing is written through an existing
path (keys included)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from donorkit.inventory import inventory_or_exit
from donorkit.render import OutExists, render_host, write_tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("host", help="donor or edge name (a key of donors.yml `donors:` or "
                                     "`edges:`)")
    parser.add_argument("out", type=Path, help="directory to lay the files out under")
    args = parser.parse_args(argv)
    # A preview: a model not pinned yet renders without --revision (the deploy refuses it).
    fleet, edges = inventory_or_exit(require_local_sources=False, require_revisions=False)
    hosts = {**fleet, **edges}
    if args.host not in hosts:
        print(f"render: no donor or edge named '{args.host}' "
              f"(known: {', '.join(sorted(hosts))})", file=sys.stderr)
        return 2
    files = render_host(hosts[args.host])
    try:
        written = write_tree(files, args.out)
    except (OutExists, OSError) as exc:
        print(f"render: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
