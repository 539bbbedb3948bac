"""`make render HOST=<donor> OUT=<dir>`: every file the deploy would write to that host, laid
out under OUT as on the box. Uses the deploy's own rendering code (donorkit.render)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from donorkit.inventory import fleet_or_exit
from donorkit.render import render_host, write_tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("host", help="donor name (a key of donors.yml)")
    parser.add_argument("out", type=Path, help="directory to lay the files out under")
    args = parser.parse_args(argv)
    fleet = fleet_or_exit(require_local_sources=False)
    if args.host not in fleet:
        print(f"render: no donor named '{args.host}' (known: {', '.join(sorted(fleet))})",
              file=sys.stderr)
        return 2
    for path in write_tree(render_host(fleet[args.host]), args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
