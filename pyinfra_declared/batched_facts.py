"""Facts that read several related things in one remote command; some answer many requests in
one program (`batch_command`/`batch_process`, used by the snapshot)."""

from __future__ import annotations

import re
import shlex

from pyinfra.api import FactBase


def sections(lines: list[str]) -> dict[str, list[str]]:
    """Split output made of `@@name` header lines followed by that section's lines."""
    found: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith("@@"):
            current = line[2:].strip()
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def first(found: dict[str, list[str]], name: str) -> str | None:
    return (found.get(name) or [None])[0] or None


def shell_glob(pattern: str) -> str:
    """`pattern` for a shell: each `*` expands, every other character is quoted."""
    return "*".join(shlex.quote(part) if part else "" for part in pattern.split("*"))


def digest_command(paths: list[str]) -> str:
    """Shell that prints one sha256 over the names and contents of `paths` (`*` expands: venv
    paths contain python3.X; everything else is quoted); absent paths count as absent."""
    listing = " ".join(map(shell_glob, paths)) or "/dev/null"  # a bare `cat` would read stdin
    return f"{{ ls -d {listing}; cat {listing}; }} 2>/dev/null | sha256sum | cut -c1-64"


_UNIT_MARK = "@@pyinfra-snapshot-unit"
_UNIT_PROPERTIES = "-p LoadState -p ActiveState -p UnitFileState -p NeedDaemonReload"


class UnitState(FactBase):
    """A unit's load/active/enabled state and whether systemd wants a daemon-reload, all in one
    command with, when asked: the digest of what it depends on as it is on disk now (OnDisk),
    the digest recorded when it was last started (Recorded), and whether a related file exists
    (Present)."""

    def command(self, unit: str, depends_on: list[str] | None = None, record: str | None = None,
                present: str | None = None) -> str:
        return "; ".join([f"systemctl show {shlex.quote(unit)} {_UNIT_PROPERTIES}",
                          *self._files(depends_on, record, present)])

    @staticmethod
    def _files(depends_on: list[str] | None = None, record: str | None = None,
               present: str | None = None) -> list[str]:
        commands = []
        if depends_on:
            commands.append(f"printf OnDisk=; {digest_command(depends_on)}")
        if record:  # printf and cat: no subshell for $(cat)
            commands.append(f"printf Recorded=; cat {shlex.quote(record)} 2>/dev/null; echo")
        if present:
            commands.append(f"[ ! -e {shlex.quote(present)} ] || echo Present=yes")
        return commands

    def process(self, output: list[str]) -> dict[str, str]:
        return dict(line.split("=", 1) for line in output if "=" in line)

    def default(self) -> dict[str, str]:
        return {}  # no systemd answering (no output): nothing known about the unit

    # Batched (snapshot.py): one `systemctl show` for every unit of a snapshot saves
    # a systemctl start and its bus connection per unit (about 5 ms of host CPU each).
    def batch_command(self, requests: list[dict]) -> str:
        units = " ".join(shlex.quote(kwargs["unit"]) for kwargs in requests)
        files = "; ".join("; ".join([f"echo {_UNIT_MARK}",
                                     *self._files(**_without(kwargs, "unit"))])
                          for kwargs in requests)
        return f"systemctl show {units} {_UNIT_PROPERTIES}; {files}"

    def batch_process(self, output: list[str], requests: list[dict]) -> list[dict[str, str]]:
        """Each request's value, as `process` gives it for that request's own command.
        systemctl prints one block a unit, in the order asked, blocks apart by a blank line."""
        cut = [i for i, line in enumerate(output) if line == _UNIT_MARK]
        shown = "\n".join(output[:cut[0]] if cut else output).split("\n\n")
        if len(cut) != len(requests) or len(shown) != len(requests):
            raise ValueError("systemctl show did not print one block per unit")
        ends = [*cut[1:], len(output)]
        files = [output[start + 1:end] for start, end in zip(cut, ends, strict=True)]
        return [self.process(block.splitlines() + lines)
                for block, lines in zip(shown, files, strict=True)]


def _without(kwargs: dict, name: str) -> dict:
    return {key: value for key, value in kwargs.items() if key != name}


class EditableInstall(FactBase):
    """Whether some distribution in the venv is installed editable from `source_dir`."""

    def command(self, venv_dir: str, source_dir: str) -> str:
        site = f"{shlex.quote(venv_dir)}/lib/python3*/site-packages"
        return (f"grep -ls {shlex.quote('file://' + source_dir.rstrip('/'))} "
                f"{site}/*.dist-info/direct_url.json || true")

    def process(self, output: list[str]) -> bool:
        return any(line.strip() for line in output)


class GitCheckout(FactBase):
    """The commit checked out in `dest` and the commit `ref` names there (None when absent)."""

    def command(self, dest: str, ref: str) -> str:
        quoted = shlex.quote(dest)
        return (f"echo @@head; git -C {quoted} rev-parse HEAD 2>/dev/null; "
                f"echo @@ref; git -C {quoted} rev-parse --verify -q "
                f"{shlex.quote(ref + '^{commit}')} 2>/dev/null; echo @@clean; "
                f"git -C {quoted} status --porcelain --untracked-files=no 2>/dev/null | head -1")

    def process(self, output: list[str]) -> dict:
        found = sections(output)
        return {"head": (found.get("head") or [None])[0],
                "ref": (found.get("ref") or [None])[0],
                "dirty": bool([line for line in found.get("clean", []) if line.strip()])}


def _quoted(paths: list[str]) -> str:
    return " ".join(shlex.quote(p) for p in paths)


class DebStatus(FactBase):
    """Which of `packages` dpkg has installed. The snapshot asks once for every install step's
    packages (batch_command). Naming them keeps the output to those: a real box has about 2000
    packages, and every line of output costs the controller time to read."""

    def command(self, packages: list[str]) -> str:
        if not packages:
            return "true"  # a bare `dpkg-query -W` would list every package
        # Exit status 1: some of them are unknown to dpkg (never installed); 2 is a real error.
        return (f"dpkg-query -W -f='${{db:Status-Abbrev}} ${{Package}}\\n' {_quoted(packages)} "
                "2>/dev/null; [ $? -le 1 ]")

    def process(self, output: list[str]) -> set[str]:
        # Status-Abbrev's second letter is the state: `i` installed; c, n, U, H, F, W, t not (yet).
        return {line.split()[-1] for line in output
                if len(line.split()) == 2 and line[1:2] == "i"}

    def default(self) -> set[str]:
        return set()

    def batch_command(self, requests: list[dict]) -> str:
        return self.command(list(dict.fromkeys(p for kwargs in requests
                                               for p in kwargs["packages"])))

    def batch_process(self, output: list[str], requests: list[dict]) -> list[set[str]]:
        """Each request's value, as `process` gives it for that request's own command."""
        installed = self.process(output)
        return [installed & set(kwargs["packages"]) for kwargs in requests]


_TEXT_MARK = "@@pyinfra-text-file "


class TextFiles(FactBase):
    """The lines of several text files in one command, {path: lines}; an absent file is left
    out (what --diff shows a multi-file operation's changes from). `awk 1` ends every file's last
    line, so the next marker starts a line of its own."""

    def command(self, paths: list[str]) -> str:
        return "".join(f"[ ! -f {shlex.quote(p)} ] || {{ echo {shlex.quote(_TEXT_MARK + p)}; "
                       f"awk 1 {shlex.quote(p)}; }}; " for p in paths) + "true"

    def process(self, output: list[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        current = None
        for line in output:
            if line.startswith(_TEXT_MARK):
                current = line[len(_TEXT_MARK):]
                found[current] = []
            elif current is not None:
                found[current].append(line)
        return found

    def default(self) -> dict:
        return {}


class PathStates(FactBase):
    """Type, owner, group and mode of each path that exists, plus the sha256 of those in
    `digest`: one command for what pyinfra's File and Sha256File read in one each per path."""

    def command(self, paths: list[str], digest: list[str] | None = None) -> str:
        command = f"stat -c '%F|%U|%G|%a|%n' {_quoted(paths)} 2>/dev/null; "
        if digest:
            command += f"sha256sum {_quoted(digest)} 2>/dev/null; "
        return command + "true"

    def process(self, output: list[str]) -> dict[str, dict]:
        states: dict[str, dict] = {}
        for line in output:
            fields = line.split("|", 4)
            if len(fields) == 5:
                kind, user, group, mode, path = fields
                states[path] = {"type": kind, "user": user, "group": group, "mode": mode}
            elif len(line) > 66 and line[64:66] == "  " and line[66:] in states:
                states[line[66:]]["sha256"] = line[:64]
        return states

    def default(self) -> dict[str, dict]:
        return {}

    # Batched (pyinfra_declared/snapshot.py): one `stat` and one `sha256sum` for every path of a
    # snapshot instead of one or two programs started per operation.
    def batch_command(self, requests: list[dict]) -> str:
        paths = [path for kwargs in requests for path in kwargs["paths"]]
        digest = [path for kwargs in requests for path in kwargs.get("digest") or []]
        return self.command(list(dict.fromkeys(paths)), list(dict.fromkeys(digest)))

    def batch_process(self, output: list[str], requests: list[dict]) -> list[dict[str, dict]]:
        """Each request's value, as `process` gives it for that request's own command."""
        states = self.process(output)
        values = []
        for kwargs in requests:
            digest = set(kwargs.get("digest") or [])
            values.append({path: dict(states[path]) if path in digest
                           else _without(states[path], "sha256")
                           for path in kwargs["paths"] if path in states})
        return values


class UserAccount(FactBase):
    """A user's passwd entry (home, shell) and the owner of its home directory, or None."""

    def command(self, user: str) -> str:
        # The home directory is the 6th field: cut by the shell (${entry#*:*:*:*:*:} drops the
        # first five), not by a subshell and `cut`.
        return (f"entry=$(getent passwd {shlex.quote(user)}) && echo \"$entry\" && "
                "home=${entry#*:*:*:*:*:} && stat -c '%U' \"${home%%:*}\" 2>/dev/null; true")

    def process(self, output: list[str]) -> dict | None:
        if not output or output[0].count(":") != 6:
            return None
        fields = output[0].split(":")
        return {"home": fields[5], "shell": fields[6],
                "home_owner": output[1] if len(output) > 1 else None}


class VenvDistributions(FactBase):
    """The distributions installed in a venv, {normalized name: version}, read from the
    *.dist-info directory names: `pip freeze` starts Python and imports pip (about 0.5 s a run
    on a 200-distribution venv) to report the same."""

    def command(self, venv_dir: str) -> str:
        site = f"{shlex.quote(venv_dir)}/lib/python3*/site-packages"
        return f"for d in {site}/*.dist-info; do echo \"${{d##*/}}\"; done"

    def process(self, output: list[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for line in output:
            stem = line.strip().removesuffix(".dist-info")
            if stem != line.strip() and "-" in stem and "*" not in stem:
                name, version = stem.rsplit("-", 1)
                found[normalized_name(name)] = version
        return found

    def default(self) -> dict[str, str]:
        return {}


def normalized_name(name: str) -> str:
    """PEP 503: case and runs of `-_.` do not distinguish distribution names."""
    return re.sub(r"[-_.]+", "-", name).lower()
