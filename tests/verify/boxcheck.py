"""Helpers for the verification suite: how to ask a box things, and how to read systemd's answers.

Kept free of pytest parametrisation so the parsing can be checked without a host
(test_boxcheck.py).
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

import pytest
from testinfra.backend.base import CommandResult
from testinfra.host import Host

from donorkit.inventory.host_data import DonorBox, ServedModel

# ---------------------------------------------------------------- skip or fail -----------------


def systemd_booted(host: Host) -> bool:
    """sd_booted()'s own test: systemd is PID 1 iff /run/systemd/system exists."""
    cached = getattr(host, "_verify_systemd", None)
    if cached is None:
        cached = host.run("test -d /run/systemd/system").rc == 0
        host._verify_systemd = cached  # type: ignore[attr-defined]
    return cached


def need_systemd(host: Host, what: str) -> None:
    """Skip (with the reason) where the box has no systemd to ask."""
    if not systemd_booted(host):
        pytest.skip(f"{what}: systemd is not PID 1 on this box")


def missing(host: Host, what: str) -> None:
    """Something the deploy lays down is absent: a failure on a systemd box (the deploy runs
    there), a skip on a box without systemd (e.g. a lent GPU machine the deploy cannot target)."""
    if systemd_booted(host):
        pytest.fail(f"{what} (systemd is PID 1, so the deploy should have installed it)",
                    pytrace=False)
    pytest.skip(f"{what}; systemd is not PID 1 on this box, so not deployed here")


def check(host: Host, command: str, what: str) -> CommandResult:
    """Run `command`; fail with its output when it exits non-zero."""
    result = host.run(command)
    if result.rc != 0:
        pytest.fail(f"{what}: `{command}` exited {result.rc}\n"
                    f"stdout: {result.stdout.strip()}\nstderr: {result.stderr.strip()}",
                    pytrace=False)
    return result


# ---------------------------------------------------------------- systemd's formats ------------

_C_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
              "s": " "}


def _unescape(text: str, i: int) -> tuple[str, int]:
    """One backslash escape starting at text[i] == '\\' (C style, as systemd writes them)."""
    if i + 1 >= len(text):
        return "\\", i + 1
    c = text[i + 1]
    if c in _C_ESCAPES:
        return _C_ESCAPES[c], i + 2
    if c == "x" and re.match(r"[0-9a-fA-F]{2}", text[i + 2:i + 4]):
        return chr(int(text[i + 2:i + 4], 16)), i + 4
    if re.match(r"[0-7]{3}", text[i + 1:i + 4]):
        return chr(int(text[i + 1:i + 4], 8)), i + 4
    return c, i + 2


def split_systemd_words(text: str) -> list[str]:
    """Split a value systemd printed (`systemctl show`'s Environment, argv[]) into words.

    systemd quotes a word that needs it with "..." (backslash escapes inside), '...' or $'...'
    (C escapes), and may backslash-escape outside quotes; whitespace separates words.
    """
    words: list[str] = []
    word: list[str] | None = None
    quote: str | None = None
    i = 0
    while i < len(text):
        c = text[i]
        if quote is None and c.isspace():
            if word is not None:
                words.append("".join(word))
                word = None
            i += 1
            continue
        word = [] if word is None else word
        if quote is None and c == "$" and text[i + 1:i + 2] == "'":
            quote, i = "$'", i + 2
        elif quote is None and c in "\"'":
            quote, i = c, i + 1
        elif quote is not None and c == quote[-1]:
            quote, i = None, i + 1
        elif c == "\\" and quote != "'":
            char, i = _unescape(text, i)
            word.append(char)
        else:
            word.append(c)
            i += 1
    if quote is not None:
        raise ValueError(f"unterminated {quote} quote in {text!r}")
    if word is not None:
        words.append("".join(word))
    return words


def parse_environment(text: str) -> dict[str, str]:
    """`systemctl show -p Environment --value` -> {name: value}; a repeated name is an error."""
    env: dict[str, str] = {}
    for word in split_systemd_words(text):
        key, sep, value = word.partition("=")
        if not sep:
            raise ValueError(f"not an assignment: {word!r}")
        if key in env:
            raise ValueError(f"{key} is set twice")
        env[key] = value
    return env


_TIME_UNITS = {"us": 1, "μs": 1, "usec": 1, "ms": 1000, "msec": 1000, "s": 10**6, "sec": 10**6,
               "": 10**6, "m": 60 * 10**6, "min": 60 * 10**6, "h": 3600 * 10**6,
               "hr": 3600 * 10**6, "d": 86400 * 10**6, "w": 7 * 86400 * 10**6,
               "M": 2629800 * 10**6, "y": 31557600 * 10**6}


def parse_timespan_us(text: str) -> int | None:
    """systemd time span ("1h", "1min 30s", "3600" = seconds, "infinity") -> microseconds."""
    text = text.strip()
    if text in ("infinity", ""):
        return None
    total = 0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-zA-Zμ]*)", text):
        if unit not in _TIME_UNITS:
            raise ValueError(f"unknown time unit {unit!r} in {text!r}")
        total += round(float(number) * _TIME_UNITS[unit])
    return total


def parse_bytes(text: str) -> int | None:
    """systemd size ("16G" = 16 GiB, "17179869184", "infinity") -> bytes."""
    text = text.strip()
    if text == "infinity":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTPE]?)", text)
    if not match:
        raise ValueError(f"not a size: {text!r}")
    return round(float(match[1]) * 1024 ** " KMGTPE".index(match[2] or " "))


def parse_exec(text: str) -> tuple[str, bool]:
    """An Exec*= line (`-+/bin/x a b`) or systemctl show's `{ path=... ; argv[]=... ;
    ignore_errors=yes ... }` -> (argv as one string, are failures ignored)."""
    text = text.strip()
    if text.startswith("{"):
        argv = re.search(r"argv\[\]=(.*?) ; ", text)
        return (argv[1] if argv else "", "ignore_errors=yes" in text)
    prefix = re.match(r"[-+@:!]*", text)[0]
    return text[len(prefix):], "-" in prefix


# One syscall of each group the unit denies: a group-form filter and the expanded list that
# systemctl show reports reduce to the same set.
_SYSCALL_OF_GROUP = {"@clock": "settimeofday", "@cpu-emulation": "vm86", "@debug": "ptrace",
                     "@module": "init_module", "@mount": "mount", "@obsolete": "uselib",
                     "@privileged": "chroot", "@raw-io": "ioperm", "@reboot": "reboot",
                     "@swap": "swapon", "@resources": "setpriority"}


def parse_syscall_filter(text: str) -> tuple[bool, frozenset[str]]:
    deny = text.startswith("~")
    words = set(text.lstrip("~").split())
    found = {_SYSCALL_OF_GROUP.get(w, w) for w in words}
    return deny, frozenset(found & set(_SYSCALL_OF_GROUP.values()))


def parse_errno(text: str) -> str:
    import errno

    return str(getattr(errno, text.strip(), text.strip()))


def parse_bind_paths(text: str) -> list[tuple[str, str]]:
    """`SRC[:DST[:OPTIONS]]` words -> (src, dst)."""
    pairs = []
    for word in text.split():
        src, _, rest = word.lstrip("-").partition(":")
        pairs.append((src, rest.split(":", 1)[0] or src))
    return sorted(pairs)


# A unit file setting -> (the property `systemctl show` reports, how to compare the two).
SERVICE_PROPERTIES: dict[str, tuple[str, Any]] = {
    "TimeoutStartSec": ("TimeoutStartUSec", parse_timespan_us),
    "TimeoutStopSec": ("TimeoutStopUSec", parse_timespan_us),
    "RestartSec": ("RestartUSec", parse_timespan_us),
    "RuntimeMaxSec": ("RuntimeMaxUSec", parse_timespan_us),
    "WatchdogSec": ("WatchdogUSec", parse_timespan_us),
    "MemoryMax": ("MemoryMax", parse_bytes),
    "MemoryHigh": ("MemoryHigh", parse_bytes),
    "OOMScoreAdjust": ("OOMScoreAdjust", int),
    "ExecStartPre": ("ExecStartPre", parse_exec),
    "SystemCallFilter": ("SystemCallFilter", parse_syscall_filter),
    "SystemCallErrorNumber": ("SystemCallErrorNumber", parse_errno),
    "RestrictAddressFamilies": ("RestrictAddressFamilies", lambda t: sorted(t.split())),
    "BindPaths": ("BindPaths", parse_bind_paths),
    "ReadWritePaths": ("ReadWritePaths", lambda t: sorted(t.split())),
}


def bus_path(unit: str) -> str:
    """The D-Bus object path systemd gives a unit (bus_label_escape)."""
    out = []
    for i, c in enumerate(unit):
        keep = c.isascii() and (c.isalpha() or (c.isdigit() and i > 0))
        out.append(c if keep else f"_{ord(c):02x}")
    return "/org/freedesktop/systemd1/unit/" + ("".join(out) or "_")


def unit_show(host: Host, unit: str, *props: str) -> dict[str, str]:
    """`systemctl show` for `unit`; fails when the unit is not loaded (not installed)."""
    need_systemd(host, f"systemd unit {unit}")
    wanted = ("LoadState", *props)
    command = "systemctl show " + " ".join(f"-p {p}" for p in wanted) + f" {shlex.quote(unit)}"
    out = check(host, command, f"systemctl show {unit}").stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if values.get("LoadState") != "loaded":
        pytest.fail(f"unit {unit} is not installed (LoadState={values.get('LoadState')})",
                    pytrace=False)
    return values


def unit_argv(host: Host, unit: str) -> list[str]:
    """ExecStart's argv as systemd loaded it: D-Bus JSON (exact words), else systemctl show."""
    unit_show(host, unit)
    result = host.run("busctl --json=short get-property org.freedesktop.systemd1 %s "
                      "org.freedesktop.systemd1.Service ExecStart", bus_path(unit))
    if result.rc == 0:
        commands = json.loads(result.stdout)["data"]
        assert len(commands) == 1, f"{unit} has {len(commands)} ExecStart commands"
        return commands[0][1]
    # Older busctl without --json: argv[] as systemctl prints it (quoted words on systemd >= 254).
    shown = unit_show(host, unit, "ExecStart")["ExecStart"]
    match = re.search(r"argv\[\]=(.*?) ; ignore_errors=", shown)
    assert match, f"cannot read argv[] from ExecStart={shown!r}"
    return split_systemd_words(match[1])


def live_unit_environment(host: Host, unit: str) -> dict[str, str]:
    """The Environment= of the installed unit, as systemd parsed it."""
    text = check(host, f"systemctl show -p Environment --value {shlex.quote(unit)}",
                 f"Environment of {unit}").stdout.strip()
    return parse_environment(text)


# ---------------------------------------------------------------- running things on the box ----


def user_home(host: Host, user: str) -> str:
    entry = host.run("getent passwd %s", user)
    if entry.rc != 0:
        missing(host, f"service user {user} does not exist")
    return entry.stdout.strip().split(":")[5]


def as_user(user: str, home: str, env: dict[str, str], script: str) -> str:
    """`script` run as `user` with exactly `env` (and what systemd adds for User=)."""
    base = {"HOME": home, "USER": user, "LOGNAME": user, "SHELL": "/bin/sh"}
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in {**base, **env}.items())
    return (f"runuser -u {shlex.quote(user)} -- env -i {assignments} "
            f"/bin/sh -c {shlex.quote(script)}")


# [Service] settings that say how the service is started and stopped, not what it may do.
NOT_SANDBOX = {"Type", "ExecStart", "ExecStartPre", "ExecStartPost", "ExecReload", "ExecStop",
               "ExecStopPost", "Restart", "RestartSec", "TimeoutStartSec", "TimeoutStopSec",
               "Environment", "EnvironmentFile", "OOMScoreAdjust", "RemainAfterExit"}


def unit_sandbox(host: Host, unit: str) -> list[str]:
    """The unit's [Service] settings that confine it (User=, ProtectSystem=, ...), from the files
    systemd loaded it from (`systemctl cat`; NeedDaemonReload=no: what runs is what is there)."""
    state = unit_show(host, unit, "NeedDaemonReload")
    if state.get("NeedDaemonReload") != "no":
        pytest.fail(f"{unit}: its files changed since systemd loaded them (daemon-reload due)",
                    pytrace=False)
    text = check(host, f"systemctl cat {shlex.quote(unit)}", f"systemctl cat {unit}").stdout
    settings, section = [], None
    for line in text.replace("\\\n", " ").splitlines():  # continuation lines joined
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith(("#", ";")):
            key = line.split("=", 1)[0].strip()
            if key not in NOT_SANDBOX:
                settings.append(line)
    return settings


def in_unit_sandbox(settings: list[str], env: dict[str, str], script: str) -> str:
    """`script` run by /bin/sh as a transient service confined exactly as the unit is (its
    User= and every sandbox setting, `systemd-run -p`), with exactly `env`."""
    props = " ".join(f"-p {shlex.quote(s)}" for s in settings)
    setenv = " ".join(f"--setenv={shlex.quote(f'{k}={v}')}" for k, v in env.items())
    # The command becomes the service's ExecStart, where systemd expands $VAR and $$ in every
    # word (systemd 252's systemd-run has no --expand-environment=no): `$$` is a literal `$`.
    return (f"systemd-run --wait --pipe --quiet --collect --service-type=exec {props} {setenv} "
            f"/bin/sh -c {shlex.quote(script.replace('$', '$$'))}")


def with_env(env: dict[str, str], script: str) -> str:
    """`script` run by /bin/sh with exactly `env` (as root: the resolution checks)."""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    return f"env -i {assignments} /bin/sh -c {shlex.quote(script)}"


def venv_python(host: Host, venv: str, code: str) -> CommandResult:
    """Run Python `code` with the venv's interpreter (which must exist)."""
    python = f"{venv}/bin/python"
    if not host.file(python).exists:
        missing(host, f"the vLLM venv's interpreter {python} does not exist")
    return host.run("%s -c %s", python, code)


def venv_json(host: Host, venv: str, code: str, what: str) -> Any:
    """Run `code` (which prints one JSON document) in the venv; fail on error."""
    result = venv_python(host, venv, code)
    if result.rc != 0:
        pytest.fail(f"{what}: the venv's python exited {result.rc}\n{result.stderr.strip()}",
                    pytrace=False)
    return json.loads(result.stdout.strip().splitlines()[-1])


# Lists (kind, sm) of every fatbin entry in a shared object: kind 1 = PTX, 2 = ELF (SASS).
# Fatbin headers stay uncompressed even when nvcc compresses the payload, so no toolkit is needed.
FATBIN_SCAN = r"""
import json, struct, sys
blob = open(sys.argv[1], "rb").read()
found, pos = set(), blob.find(b"\x50\xed\x55\xba")
while pos != -1:
    _, _, hsize, fsize = struct.unpack_from("<IHHQ", blob, pos)
    entry, end = pos + hsize, min(pos + hsize + fsize, len(blob))
    while entry + 32 <= end:
        kind, _, ehsize, size = struct.unpack_from("<HHIQ", blob, entry)
        if kind in (1, 2):
            found.add((kind, struct.unpack_from("<I", blob, entry + 28)[0]))
        if not ehsize:
            break
        entry += ehsize + size
    pos = blob.find(b"\x50\xed\x55\xba", max(end, pos + 4))
print(json.dumps(sorted(found)))
"""


def sm(arch: str) -> str:
    """Compute capability "8.9" -> "sm_89"."""
    return "sm_" + arch.replace(".", "")


def sass_archs(host: Host, cuda_home: str, python: str, so_path: str) -> tuple[set[str], str]:
    """The sm_XY a shared object carries SASS for, and how that was found out."""
    cuobjdump = f"{cuda_home}/bin/cuobjdump"
    if host.file(cuobjdump).exists:
        out = check(host, f"{cuobjdump} --list-elf {shlex.quote(so_path)}", "cuobjdump").stdout
        return set(re.findall(r"\b(sm_\d+a?)\b", out)), "cuobjdump --list-elf"
    out = check(host, f"{python} -c {shlex.quote(FATBIN_SCAN)} {shlex.quote(so_path)}",
                "fatbin scan").stdout
    return {f"sm_{arch}" for kind, arch in json.loads(out) if kind == 2}, "fatbin headers"


# ---------------------------------------------------------------- Caddy's adapted JSON ---------


def walk(node: Any):
    """Every dict inside a JSON document."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def reverse_proxies(node: Any) -> list[dict]:
    return [d for d in walk(node) if d.get("handler") == "reverse_proxy"]


def routes_for_host(config: dict, hostname: str) -> list[dict]:
    """Top-level HTTP routes whose matcher names `hostname`."""
    found = []
    for server in config.get("apps", {}).get("http", {}).get("servers", {}).values():
        for route in server.get("routes", []):
            if any(hostname in m.get("host", []) for m in route.get("match", [])):
                found.append(route)
    return found


def loggers_for_host(config: dict, hostname: str) -> list[dict]:
    """The logging.logs entries a hostname's access log goes to."""
    logs = config.get("logging", {}).get("logs", {})
    names: list[str] = []
    for server in config.get("apps", {}).get("http", {}).get("servers", {}).values():
        found = server.get("logs", {}).get("logger_names", {}).get(hostname, [])
        names += [found] if isinstance(found, str) else found  # 2.6: a name; 2.11: a list
    return [logs[n] for n in names if n in logs]


def listeners(ss_output: str) -> list[tuple[str, int, str]]:
    """`ss -ltnpH` lines -> (address, port, process names)."""
    found = []
    for line in ss_output.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        address, _, port = fields[3].rpartition(":")
        procs = ",".join(re.findall(r'\("([^"]+)",pid=', line)) or "?"
        found.append((address.strip("[]"), int(port), procs))
    return found


# ---------------------------------------------------------------- the unit's environment -------


def expected_environment(data: DonorBox, model: ServedModel) -> dict[str, str]:
    """What the unit's Environment= must be: the inventory's, plus the stack digest where the
    deploy writes one (render.DIGEST_VARIABLE / unit_digest, when donorkit defines them)."""
    from donorkit.render import templates as render

    env = {k: str(v) for k, v in render.unit_environment(data, model).items()}
    if hasattr(render, "unit_digest") and hasattr(render, "DIGEST_VARIABLE"):
        env[render.DIGEST_VARIABLE] = render.unit_digest(data, model)
    return env


def unit_env(host: Host, data: DonorBox, model: ServedModel) -> tuple[dict[str, str], str]:
    """The environment the model's unit runs with, and where it came from.

    With systemd as PID 1: read back from the installed unit (a missing unit fails). Without:
    the inventory's environment, which is what the deploy would write.
    """
    from donorkit.render import templates as render

    if systemd_booted(host):
        unit_show(host, model.unit)
        return live_unit_environment(host, model.unit), f"installed unit {model.unit}"
    env = {k: str(v) for k, v in render.unit_environment(data, model).items()}
    return env, "render.unit_environment (systemd is not PID 1 here: no unit to read back)"
