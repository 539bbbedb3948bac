"""`donors`: the operator's one command. Each action calls the module of donorkit/commands/ that
does it (status, pin, accept, reference, rollout, render_cli, join_file; pyinfra for deploy and
join, pytest for verify), imported only by the action that needs it (`donors --help` stays instant).

The operator's data lives in a fleet directory outside the checkout (`--fleet DIR` or
$DONORS_FLEET; `donors init DIR` makes one), else this checkout's example inventory/donors.yml.
Every operator mistake is one line, `donors: <file>: <host>: field '<f>': <what>`, and an exit
code of the table in `donors --help` (donorkit/inventory/errors.py); never a traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from donorkit.inventory import errors
from donorkit.inventory.errors import DonorsError
from donorkit.inventory.paths import FLEET_DONORS, FLEET_ENV, REPO_ROOT, donors_file

BIN = Path(sys.executable).parent
INIT_HEADER = """\
# This fleet's inventory: one entry per donor box and per edge (`donors --fleet {fleet} ...`,
# or DONORS_FLEET={fleet}). Made by `donors init` from the toolkit's example
# (inventory/donors.yml); every key a donor or edge may hold: docs/reference.md. The toolkit's
# defaults (inventory/defaults.yml, in the checkout) apply unless `overrides:` below or a
# donor's own `overrides:` sets a key. Relative paths here (pki_dir, ssh_key, hf_token_file,
# the caches) are taken from this directory, which also holds pki/ (the private CA: back it
# up), results/ and the caches; a `git pull` of the toolkit never touches it.
#
# The models this fleet serves, pinned here (not in the toolkit's defaults.yml): `donors pin`
# writes each checkpoint's commit as its `revision:`.
"""


class Usage(DonorsError):
    """A usage mistake found by the command itself."""


def _fleet(value: str | None) -> None:
    """--fleet DIR (or $DONORS_FLEET): the operator's data directory, checked and exported so
    that every module and subprocess (pyinfra, pytest) reads the same inventory and paths."""
    explicit = bool(value)
    value = value or os.environ.get(FLEET_ENV)
    if not value:
        return
    fleet = Path(value).expanduser().resolve()
    if not (fleet / FLEET_DONORS).is_file():
        raise Usage(f"{fleet}: not a fleet directory (no {FLEET_DONORS}): make one with "
                    f"`donors init {value}`")
    os.environ[FLEET_ENV] = str(fleet)
    # --fleet names the donors file too; $DONORS_FLEET leaves a $DONORS_FILE as paths.donors_file
    if explicit or not os.environ.get("DONORS_FILE"):
        os.environ["DONORS_FILE"] = str(fleet / FLEET_DONORS)


def _inventory(limit: list[str] | None = None, *, sources: bool = False,
               revisions: bool = False):
    """The validated inventory (donors, edges), narrowed by --limit: a DonorsError (one line)
    before anything touches a box."""
    from donorkit.inventory.fleet import check_revisions, load_inventory
    from donorkit.inventory.limit import select
    from donorkit.inventory.paths import pki_dir
    from donorkit.inventory.pki import Pki

    fleet, edges = load_inventory(require_local_sources=sources)
    if revisions:
        check_revisions(fleet)
    for directory in sorted({pki_dir(box) for box in [*fleet.values(), *edges.values()]}):
        Pki(directory).check()
    return select(limit, fleet, edges)


def _run(command: list[str | Path], env: dict[str, str] | None = None) -> int:
    return subprocess.run([str(c) for c in command], cwd=REPO_ROOT,
                          env={**os.environ, **(env or {})}).returncode


def cmd_init(args: argparse.Namespace) -> int:
    import yaml

    from donorkit.inventory.fleet import DEFAULTS_FILE, read_yaml

    fleet = Path(args.dir).expanduser().resolve()
    target = fleet / FLEET_DONORS
    if target.exists():
        raise Usage(f"{target}: already exists: a fleet is never overwritten")
    example = (REPO_ROOT / "inventory" / "donors.yml").read_text()
    served = sorted({m for d in (yaml.safe_load(example)["donors"] or {}).values()
                     for m in d.get("routes", {}).values()})
    models = read_yaml(DEFAULTS_FILE)["models"]
    pins = "".join(f"    {m}:\n      checkpoint: {models[m]['checkpoint']}\n"
                   f"      revision: {models[m].get('revision') or 'null'}\n" for m in served)
    text = INIT_HEADER.format(fleet=args.dir) + f"overrides:\n  models:\n{pins}\n" + example
    try:
        fleet.mkdir(parents=True, exist_ok=True)
        with target.open("x") as handle:
            handle.write(text)
    except OSError as exc:
        raise Usage(f"{target}: cannot be written: {exc.strerror or exc}") from None
    print(f"donors: made {target} from the example. Next: edit it (your boxes, their "
          f"routes), then `donors --fleet {args.dir} pin` and `donors --fleet {args.dir} "
          "deploy --dry`")
    return errors.OK


def cmd_deploy(args: argparse.Namespace) -> int:
    from donorkit.render.canary_files import canary_config

    donors, edges = _inventory(args.limit, sources=True, revisions=True)  # refused: one line
    for edge in edges.values():
        canary_config(edge)     # the references it ships: a broken one refused here, one line
    command = [BIN / "pyinfra", "inventory/gpus.py", "deploy.py"]
    command += [f"--limit={pattern}" for pattern in args.limit]
    command += ["--dry"] * args.dry + ["--diff"] * args.diff + ["-y"] * args.yes
    rc = _run(command + args.pyinfra_args)
    home = [name for name, box in donors.items() if box.reach == "tunnel"]
    if rc and home:
        # pyinfra's word for a tunnel address nobody answers yet is `No existing session`.
        print(f"donors: home donors {', '.join(home)} are reached through the tunnel: "
              "`SSH error (No existing session)` for one of them means its box has not joined "
              "yet (donors join-file, then `donors join` on the box: README \"A home donor "
              "behind NAT\")", file=sys.stderr)
    return errors.FAILED if rc else errors.OK


def cmd_render(args: argparse.Namespace) -> int:
    from donorkit.commands import render_cli

    return render_cli.run(args.host, Path(args.out))


def cmd_status(args: argparse.Namespace) -> int:
    from donorkit.commands import status

    _inventory(args.limit)
    return status.main([*(f"--limit={p}" for p in args.limit), *["--json"] * args.json,
                        *["--verbose"] * args.verbose, f"--timeout={args.timeout}"])


def cmd_pin(args: argparse.Namespace) -> int:
    from donorkit.commands import pin as lock

    _inventory()
    return lock.main([f"--branch={args.branch}", *["--all"] * args.all,
                      f"--timeout={args.timeout}"])


def cmd_verify(args: argparse.Namespace) -> int:
    _inventory(args.limit)
    return _run([BIN / "python", "-m", "pytest", "-q", "-n", "auto", "tests/verify",
                 *(f"--limit={p}" for p in args.limit), *args.pytest_args])


def cmd_accept(args: argparse.Namespace) -> int:
    from donorkit.commands import accept

    if not _inventory(args.limit)[0]:
        raise Usage(f"--limit {','.join(args.limit)}: selects no donor")
    return accept.main([*(f"--limit={p}" for p in args.limit),
                        *([f"--via={args.via}"] if args.via else []),
                        *([f"--results={args.results}"] if args.results else [])])


def cmd_reference(args: argparse.Namespace) -> int:
    from donorkit.commands import reference

    donors = _inventory(args.limit)[0]
    if not donors:
        raise Usage(f"--limit {','.join(args.limit)}: selects no donor")
    return reference.run(donors, bool(args.limit), args.timeout)


def cmd_rollout(args: argparse.Namespace) -> int:
    from donorkit.commands import rollout

    if not args.inventory:      # another inventory file (inventory/testbed.py) loads its own
        _inventory()
    return rollout.main([*([f"--batch={args.batch}"] if args.batch else []),
                         *([f"--from={args.start}"] if args.start else []),
                         *([f"--inventory={args.inventory}"] if args.inventory else []),
                         *["--plan"] * args.plan, *["--unlock"] * args.unlock,
                         *(["--", *args.pyinfra_args] if args.pyinfra_args else [])])


def cmd_join_file(args: argparse.Namespace) -> int:
    from donorkit.commands import join_file as tunnel_join

    fleet = _inventory()[0]
    if args.donor not in fleet:
        raise Usage(f"{donors_file()}: no donor named '{args.donor}' "
                    f"(donors: {', '.join(fleet)})")
    return tunnel_join.main(["join-file", args.donor, args.out])


def cmd_join(args: argparse.Namespace) -> int:
    from donorkit.commands import join_file as tunnel_join

    said = ["--fingerprint", args.fingerprint]
    rc = tunnel_join.main(["check", args.join, *said])
    if rc:
        return rc
    rc = _run([BIN / "pyinfra", "-y", "inventory/join.py", "deploy.py"],
              {"JOIN_FILE": str(Path(args.join).resolve()), "JOIN_FINGERPRINT": args.fingerprint})
    return rc or tunnel_join.main(["box-keys", args.join, *said])


def _limit(parser: argparse.ArgumentParser, what: str = "hosts") -> None:
    parser.add_argument("--limit", action="append", default=[], metavar="PATTERN",
                        help=f"only these {what}: names, groups (donors, edges, a card profile "
                             "such as rtx4090) or globs (tb-*), as pyinfra's --limit "
                             "(repeatable, or a comma list); one matching nothing is refused")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="donors", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Turn volunteers' GPU boxes into serving nodes of the network, and keep "
                    "them there. The fleet: --fleet DIR, or $DONORS_FLEET; without either, "
                    "this checkout's example inventory/donors.yml.",
        epilog=errors.EXIT_CODES)
    top.add_argument("--fleet", metavar="DIR",
                     help="the operator's data directory (donors.yml, pki/, results/, caches); "
                          "default $DONORS_FLEET")
    sub = top.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, summary: str, func):
        p = sub.add_parser(name, help=summary, description=summary)
        p.set_defaults(func=func)
        return p

    p = action("init", "make a new fleet directory from the example inventory", cmd_init)
    p.add_argument("dir", help="the fleet directory (made; an existing donors.yml is refused)")
    p = action("deploy", "deploy the fleet (pyinfra inventory/gpus.py deploy.py)", cmd_deploy)
    _limit(p)
    p.add_argument("--dry", action="store_true", help="say what would change; change nothing")
    p.add_argument("--diff", action="store_true", help="show the diff of each changed file")
    p.add_argument("-y", "--yes", action="store_true", help="no confirmation prompt")
    p.add_argument("pyinfra_args", nargs="*", metavar="-- PYINFRA_ARGS",
                   help="after --: passed to pyinfra as they are")
    p = action("render", "every file the deploy would write to one host, under OUT", cmd_render)
    p.add_argument("host", help="a donor or edge of the inventory")
    p.add_argument("out", help="a directory that does not exist yet")
    p = action("status", "the fleet at a glance: one row per box (-v: every column)",
               cmd_status)
    _limit(p)
    p.add_argument("--json", action="store_true", help="one JSON document, nothing else")
    p.add_argument("-v", "--verbose", action="store_true", help="the wide table")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds for each connection (10)")
    pin = action("pin", "pin each served model's checkpoint to a hub commit (or: lock)", cmd_pin)
    # `lock`, the old name (make lock): the same action, not listed twice.
    lock = sub.add_parser("lock", description=pin.description)
    lock.set_defaults(func=cmd_pin)
    for p in (pin, lock):
        p.add_argument("--branch", default="main", help="the branch or tag to pin (main)")
        p.add_argument("--all", action="store_true", help="every model profile, served or not")
        p.add_argument("--timeout", type=float, default=20.0, help="seconds per lookup (20)")
    p = action("verify", "the verification suite against the fleet (pytest tests/verify)",
               cmd_verify)
    _limit(p)
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS",
                   help="after --: passed to pytest")
    p = action("accept", "acceptance run per donor through its public hostname", cmd_accept)
    _limit(p, "donors")
    p.add_argument("--via", metavar="URL", help="through this base URL (an edge)")
    p.add_argument("--results", metavar="DIR",
                   help="where records go (default: acceptance.results_dir)")
    p = action("reference", "record the canaries' reference on the trusted builders",
               cmd_reference)
    _limit(p, "donors (trusted builders only)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds for each canary request (60)")
    p = action("rollout", "the fleet a batch at a time, each in service before the next",
               cmd_rollout)
    p.add_argument("--batch", type=int, help="boxes at a time (default: inventory data)")
    p.add_argument("--from", dest="start", metavar="HOST", help="resume from this box")
    p.add_argument("--inventory", help="the pyinfra inventory file (inventory/gpus.py)")
    p.add_argument("--plan", action="store_true", help="print the plan; touch nothing")
    p.add_argument("--unlock", action="store_true", help="clear a stale rollout lock")
    p.add_argument("pyinfra_args", nargs="*", metavar="-- PYINFRA_ARGS",
                   help="after --: passed to pyinfra")
    p = action("join-file", "a home donor's signed join file (on the operator's machine)",
               cmd_join_file)
    p.add_argument("donor", help="the home donor (reach: tunnel)")
    p.add_argument("out", help="the file to write (must not exist)")
    p = action("join", "join a home donor's box to the tunnel (on the box, as root)", cmd_join)
    p.add_argument("join", help="the join file the operator sent")
    p.add_argument("--fingerprint", required=True, help="the operator's CA fingerprint")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.func is not cmd_init:       # init makes the fleet the others read
            _fleet(args.fleet)
        return args.func(args)
    except DonorsError as exc:
        print(f"donors: {errors.one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("donors: interrupted", file=sys.stderr)
        return errors.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
