"""The inventory's schema: every key of defaults.yml, of a donor entry and of `overrides`, with its
type, shape and range, in one place. Read this file as the reference of what the data may say.

Validated with pydantic v2 (already installed as a dependency of pyinfra; pinned in
pyproject.toml): strict types (`"30"` is not an int, `Api-Key` is not a list), unknown keys
refused, and each error located by a path (`models.qwen.port`) that donorkit.fleet turns into one
line naming the file, the donor and the field.

How the pieces fit (donorkit.fleet does the loading):
- `Defaults` is defaults.yml. A donors file is `Inventory`: `donors:` (one `Donor` per box) and
  an optional file-wide `overrides:`.
- A donor's effective settings = defaults.yml, deep-merged with the file's `overrides:`, then with
  the donor's own `overrides:` (mappings merge key by key at every depth, so
  `overrides: {models: {qwen: {port: 18887}}}` changes one field of one profile; lists and scalars
  replace; `vllm_exl3_plugin` is replaced whole, it is one of two shapes). The merged result is
  validated again as a `Defaults`, then the donor's cross-checks run (`check_box`).
- An edge (`edges:`, `Edge`) is the front door: its own SSH settings, the public hostnames it
  serves (a list, or `all`: every hostname some donor routes), its Caddy source and its rate
  limit (`RateLimit`, or null: none). Its settings are defaults.yml merged with the file's and its
  own `overrides:` as for a donor; its upstreams are worked out from the donors' routes
  (donorkit.fleet), so adding or removing a donor changes the pools on the next run.
"""


import ipaddress
import re
import socket
import unicodedata
from typing import Annotated, Any, Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# ------------------------------------------------------------------ value types --------------


# Characters no inventory string may hold, wherever it lands: control characters (a newline
# writes its own unit or Caddyfile line), format characters (bidi overrides, zero-width: what is
# shown is not what is written), line and paragraph separators, surrogates and private use.
_REFUSED_CATEGORIES = {"Cc": "control", "Cf": "format", "Zl": "line separator",
                       "Zp": "paragraph separator", "Cs": "surrogate", "Co": "private use"}


def _no_control(text: str) -> str:
    """THE rule every string of the inventory obeys (keys included, at any depth, donors and
    edges, known fields or not: check_strings walks the files with it before anything else):
    no control, format or separator characters; no backslash (an escape in every file the
    deploy writes: it would continue a unit line, or escape Caddy's closing quote); no `{$`
    (Caddy substitutes environment variables there before it reads a token). Which further
    characters a field may hold (braces, quotes, whitespace) is its type below."""
    for char in text:
        category = unicodedata.category(char)
        if category in _REFUSED_CATEGORIES:
            raise ValueError(f"{_REFUSED_CATEGORIES[category]} character {char!r} is not allowed")
    if "\\" in text:
        raise ValueError("a backslash is not allowed (an escape in units and Caddyfiles)")
    if "{$" in text:
        raise ValueError("'{$' is not allowed (Caddy reads it as an environment variable)")
    return text


def check_strings(node: Any, path: tuple = ()) -> tuple[tuple, str] | None:
    """The first string of a parsed YAML document, key or value, at any depth, that breaks the
    rule of _no_control: (its path, the problem), or None. donorkit.fleet runs it on each file
    before validating anything, so no field, known or not, is exempt."""
    if isinstance(node, str):
        try:
            _no_control(node)
        except ValueError as exc:
            return path, str(exc)
        return None
    items = (node.items() if isinstance(node, dict)
             else enumerate(node) if isinstance(node, list) else ())
    for key, value in items:
        if isinstance(key, str):
            found = check_strings(key, (*path, key))
            if found:
                return found[0], f"key: {found[1]}"
        found = check_strings(value, (*path, key))
        if found:
            return found
    return None


def _matching(pattern: str, what: str) -> AfterValidator:
    compiled = re.compile(pattern)

    def check(text: str) -> str:
        if not compiled.fullmatch(text):
            raise ValueError(f"{text!r} is not {what}")
        return text

    return AfterValidator(check)


Text = Annotated[str, AfterValidator(_no_control)]
"""Any string without control characters (quoted wherever it is written)."""

Name = Annotated[str, Field(max_length=63),
                 _matching(r"[a-z0-9][a-z0-9-]*", "a name (lowercase letters, digits, '-'; "
                                                  "not starting with '-')")]
"""Donor names, card profiles and model identities: they become file and unit names."""


# One path component: letters, digits and `._+@=,~-` (no whitespace, quotes, braces, `$`, `%`,
# `;`, `#`: nothing a shell, a unit or a Caddyfile reads as syntax).
_COMPONENT = r"[A-Za-z0-9._+@=,~-]+"


def _abs_path(text: str) -> str:
    if not re.fullmatch(rf"(/{_COMPONENT})+|/", text) or \
            any(part in (".", "..") for part in text.split("/")):
        raise ValueError(f"{text!r} is not an absolute path of letters, digits and '._+@=,~-' "
                         "(no whitespace, quotes, braces, '.' or '..')")
    return text


AbsPath = Annotated[str, AfterValidator(_no_control), AfterValidator(_abs_path)]
"""A path on the box: absolute, plain characters only, no `.` or `..` components."""


def under(root: str, what: str) -> AfterValidator:
    """An AbsPath strictly below `root` (the directory its service owns)."""
    def check(text: str) -> str:
        if not text.startswith(f"{root}/"):
            raise ValueError(f"{text!r} is not under {root}/ ({what})")
        return text

    return AfterValidator(check)


def _install_root(text: str) -> str:
    if not re.fullmatch(rf"/(opt|srv)/{_COMPONENT}(/{_COMPONENT})*", text):
        raise ValueError(f"{text!r} is not a directory of the deploy's own under /opt/ or /srv/ "
                         "(it is created and chowned root: never a system directory)")
    return text


LocalPath = Annotated[str, Field(min_length=1), AfterValidator(_no_control),
                      _matching(r"[A-Za-z0-9._+@=,~/-]+", "a path of letters, digits and "
                                                         "'._+@=,~/-' (no whitespace or quotes)")]
"""A path on the operator's machine; relative paths are relative to the repository root."""

UserName = Annotated[str, _matching(r"[a-z_][a-z0-9_-]{0,31}",
                                    "a user name (lowercase, at most 32 characters)")]


# Accounts a Debian/Ubuntu box already has (base-passwd, sshd, systemd, Caddy's package): the
# service user is vLLM's own, so the deploy never takes one of these over (it sets the shell to
# nologin and the home; `caddy` would hand the engine Caddy's keys, `root` the box).
RESERVED_USERS = frozenset({
    "root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp",
    "proxy", "www-data", "backup", "list", "irc", "gnats", "nobody", "_apt", "sshd", "caddy",
    "messagebus", "syslog", "polkitd", "uuidd", "tcpdump", "tss", "landscape", "pollinate",
    "usbmux", "dnsmasq", "avahi", "ntp", "_chrony", "nvidia-persistenced", "ubuntu", "debian",
    "admin", "operator", "adm", "sudo", "staff", "users", "nogroup", "disk", "video", "render"})


def _not_root(text: str) -> str:
    if text == "root":
        raise ValueError("the service must not run as root")
    if text in RESERVED_USERS or text.startswith("systemd-"):
        raise ValueError(f"{text!r} is a system account or group of the box (caddy, root, "
                         "sshd, ...): the service user is vLLM's own")
    return text


Port = Annotated[int, Field(ge=1, le=65535)]
Hostname = Annotated[str, Field(max_length=253), _matching(
    r"([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}", "a DNS hostname")]
"""A public hostname (lowercase, fully qualified)."""

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"


def _ssh_host(text: str) -> str:
    if "%" in text:
        raise ValueError(f"{text!r}: an IPv6 zone id ('%...') is not allowed (it is not part of "
                         "an address a Caddyfile or another host could use)")
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        address = None
    if address is not None:
        if address.is_unspecified or address.is_multicast:
            raise ValueError(f"{text!r} is not the address of one box")
        return text
    if len(text) > 253 or not re.fullmatch(rf"{_LABEL}(\.{_LABEL})*\.?", text):
        raise ValueError(f"{text!r} is not a hostname or an IP address")
    try:  # 127.1, 0x7f.0.0.1, 2130706433: the resolver reads them as IPv4 addresses
        socket.inet_aton(text)
    except OSError:
        return text
    raise ValueError(f"{text!r} is another spelling of an IPv4 address: write it as a.b.c.d")


SshHost = Annotated[str, AfterValidator(_no_control), AfterValidator(_ssh_host)]
"""What pyinfra connects to: a hostname or an IPv4/IPv6 address (never empty, never `-...`, no
zone id, no inet_aton spelling like `127.1`)."""


def box_identity(host: str) -> str:
    """One spelling per box, as far as it can be known offline: hostnames lowercased without
    the trailing dot, IPv6 compressed, IPv4-mapped IPv6 as IPv4, and localhost, ::1 and
    127.0.0.1 as one (other 127/8 addresses stay apart: a relay may listen on each). Two
    inventory entries with one identity are one box (their Caddyfiles would fight), whatever
    their SSH ports."""
    name = host.lower().rstrip(".")
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return "127.0.0.1" if name == "localhost" or name.endswith(".localhost") else name
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if address == ipaddress.ip_address("::1") or address.is_unspecified:
        return "127.0.0.1"
    return address.compressed

Url = Annotated[str, _matching(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%+/-]*)?",
                               "an http(s) URL (host, optional port and path; no query)")]
GitUrl = Annotated[str, _matching(
    r"(https?|git|ssh)://[A-Za-z0-9.@:-]+(/[A-Za-z0-9._~%+/-]*)?|file:///[A-Za-z0-9._~%+/-]+",
    "a git URL (http(s)://, git://, ssh:// or file:///; no query)")]
UrlTemplate = Annotated[str, _matching(
    r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/([A-Za-z0-9._~%+/-]|\{distro\})*)?",
    "an http(s) URL (may contain {distro})")]
GitRef = Annotated[str, Field(max_length=200),
                   _matching(r"[A-Za-z0-9][A-Za-z0-9._/+-]*", "a git tag, branch or commit")]
Version = Annotated[str, _matching(r"[0-9][0-9A-Za-z.+-]*", "a version (e.g. 0.26.0)")]
DriverVersion = Annotated[str, _matching(r"[0-9]+(\.[0-9]+)*", "an NVIDIA driver version "
                                                               "(e.g. 580.65.06)")]
VllmVariant = Annotated[str, _matching(r"cu[0-9]{3}", "a CUDA variant like cu129")]
WheelUrlTemplate = Annotated[str, _matching(
    r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/([A-Za-z0-9._~%+/-]|\{version\}|\{variant\})*)?",
    "an http(s) URL (may contain {version} and {variant})")]
Arch = Annotated[str, _matching(r"[0-9]+\.[0-9]+", "a compute capability MAJOR.MINOR")]
CudaVersion = Annotated[str, _matching(r"[0-9]+\.[0-9]+", "a CUDA version MAJOR.MINOR")]
DebPackage = Annotated[str, _matching(r"[a-z0-9][a-z0-9+.-]+", "a Debian package name")]
Distro = Annotated[str, _matching(r"[a-z]+[0-9]+", "<ID><VERSION_ID without dots>")]
FileName = Annotated[str, _matching(r"[A-Za-z0-9][A-Za-z0-9._+-]*", "a file name")]
EnvName = Annotated[str, _matching(r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable name")]
HeaderName = Annotated[str, _matching(r"[A-Za-z0-9][A-Za-z0-9-]*", "an HTTP header name")]
_DURATION_UNITS = {"ns": 1, "us": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9,
                   "h": 3600 * 10**9}
_DURATION_PART = re.compile(r"([0-9]+)(?:\.([0-9]+))?(ns|us|ms|s|m|h)")
MAX_DURATION_NS = 24 * 3600 * 10**9


def duration_ns(text: str) -> int:
    """A Caddy duration (Go's time.ParseDuration: `5s`, `250ms`, `1m30s`, `1.5h`; no sign, no
    bare number, no `d`) in whole nanoseconds, as Go computes it. THE duration parser: the
    schema's Duration types, the templates (caddy_duration) and the rollout all use it."""
    if not isinstance(text, str) or not re.fullmatch(rf"(?:{_DURATION_PART.pattern})+", text):
        raise ValueError(f"{text!r} is not a Caddy duration (e.g. 5s, 250ms, 1m30s)")
    total = 0
    for whole, fraction, unit in _DURATION_PART.findall(text):
        scale = _DURATION_UNITS[unit]
        total += int(whole) * scale + (int(fraction) * scale // 10**len(fraction)
                                       if fraction else 0)
    return total


def duration_seconds(text: str) -> float:
    """duration_ns in seconds."""
    return duration_ns(text) / 10**9


def caddy_duration(text: str) -> str:
    """The duration as the templates write it: its value in the largest unit that keeps it
    whole (`1m30s` -> `90s`, `1.5s` -> `1500ms`): what Caddy reads is what the rollout waits."""
    total = duration_ns(text)
    for unit in ("s", "ms", "us"):
        if total % _DURATION_UNITS[unit] == 0:
            return f"{total // _DURATION_UNITS[unit]}{unit}"
    return f"{total}ns"


def _duration(minimum_ns: int) -> AfterValidator:
    def check(text: str) -> str:
        total = duration_ns(text)
        if total < minimum_ns or total > MAX_DURATION_NS:
            low = "0s" if minimum_ns == 0 else "more than 0s"
            raise ValueError(f"{text!r} is out of range ({low}, at most 24h)")
        return text

    return AfterValidator(check)


Duration = Annotated[str, _duration(1)]
"""A Caddy duration above zero, at most 24h (an interval of 0s is Caddy's default of 30s, not
what the rollout would wait)."""
DurationOrZero = Annotated[str, _duration(0)]
"""A Caddy duration, 0s allowed (where Caddy reads 0 as `off`: lb_try_duration)."""

# Where a client's request cannot choose the value: the connection's own address. A header, the
# Host, the URI or the remote port would let each client pick its own bucket.
SERVER_KNOWN_KEYS = ("{remote_host}", "{http.request.remote.host}")
Placeholder = Annotated[str, _matching(r"\{[a-z][A-Za-z0-9_.>-]*\}",
                                       "a Caddy placeholder (e.g. {remote_host})")]


def _server_known(text: str) -> str:
    if text not in SERVER_KNOWN_KEYS:
        raise ValueError(f"{text!r} is chosen by the client or not known per connection: use "
                         f"one of {', '.join(SERVER_KNOWN_KEYS)}")
    return text
UriPath = Annotated[str, _matching(r"/[A-Za-z0-9._~/-]*", "a URI path (e.g. /v1/models)")]
Executable = Annotated[str, _matching(rf"[A-Za-z0-9._+-]+|(/{_COMPONENT})+",
                                      "a command name or an absolute path")]
ExecutableTemplate = Annotated[str, AfterValidator(_no_control),
                               _matching(rf"(\{{venv_dir\}})?(/{_COMPONENT})+",
                                         "an absolute path (may start with {venv_dir})")]
Commit = Annotated[str, _matching(r"[0-9a-f]{40}", "a commit hash (40 lowercase hex digits)")]
"""A checkpoint's pinned revision: a full commit hash, never a branch or a tag that can move."""

Checkpoint = Annotated[str, AfterValidator(_no_control), _matching(
    rf"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?|(/{_COMPONENT})+",
    "a Hugging Face repository id (owner/name) or an absolute path")]


def _requirement(text: str) -> str:
    try:
        Requirement(text)
    except InvalidRequirement:
        raise ValueError(f"{text!r} is not a pip requirement (name==version)") from None
    if text.startswith("-") or any(c.isspace() for c in text):
        raise ValueError(f"{text!r} is not a pip requirement (name==version)")
    return text


PipRequirement = Annotated[str, AfterValidator(_requirement)]

# vLLM's `vllm serve` flags the deploy owns. vLLM's FlexibleArgumentParser treats `_` and `-`
# alike in option names and is an argparse parser with allow_abbrev left on (so `--hos` is
# `--host`); `--config FILE` pulls any option (host, port, served-model-name) from a YAML file;
# `--model` replaces the positional checkpoint; `--revision` / `--tokenizer-revision` come from
# the model's pinned `revision` (the weights fetched are the weights served).
DEPLOY_OWNED_ARGS = ("--host", "--port", "--served-model-name", "--model", "--config",
                     "--revision", "--tokenizer-revision")


def owned_option(arg: str) -> str | None:
    """The deploy-owned flag `arg` would set in vLLM's parser, if any: `--x=v`, `--x.key`,
    `_` for `-` and unambiguous prefixes all count. Every argument is checked, values too:
    argparse reads `--host=0.0.0.0` as an option wherever it stands."""
    if not arg.startswith("--") or len(arg) < 3:
        return None
    name = re.split(r"[=.]", arg, maxsplit=1)[0].replace("_", "-")
    for owned in DEPLOY_OWNED_ARGS:
        if owned.startswith(name):
            return owned
    return None


def _model_arg(value: str | int | float) -> str:
    text = str(value)
    _no_control(text)
    owned = owned_option(text)
    if owned:
        raise ValueError(f"{text!r} would set {owned}, which the deploy owns "
                         "(--host 127.0.0.1, the model's port, no alias, no config file)")
    return text


ModelArg = Annotated[str | int | float, AfterValidator(_model_arg)]


class Strict(BaseModel):
    """Every section: strict types, unknown keys refused."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def _unit_text(value: str | int | bool) -> str:
    """A unit_service value as systemd reads it (booleans yes/no)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _setting(pattern: str, what: str) -> Any:
    """A [Service] value of this shape (after the one rule: no control characters, no
    backslash, so nothing continues onto or writes another line)."""
    compiled = re.compile(pattern)

    def check(value: str | int | bool) -> str | int | bool:
        text = _unit_text(value)
        _no_control(text)
        if not compiled.fullmatch(text):
            raise ValueError(f"{text!r} is not {what}")
        return value

    return Annotated[str | int | bool, AfterValidator(check)]


# The only commands that may run with full privileges (`+`, `!`, `!!` prefixes), per key: the
# defaults' own. Anything else in an Exec setting runs as the service user, in its sandbox.
PRIVILEGED_EXEC = {"ExecStartPre": ("-+/usr/bin/nvidia-modprobe -u -c=0",)}


def _exec(key: str) -> Any:
    def check(value: str) -> str:
        _no_control(value)
        prefix = re.match(r"[-@:+!]*", value)[0]
        if ("+" in prefix or "!" in prefix) and value not in PRIVILEGED_EXEC.get(key, ()):
            allowed = PRIVILEGED_EXEC.get(key)
            raise ValueError(f"{value!r}: '+' and '!' run a command with full privileges; "
                             + (f"only {' or '.join(map(repr, allowed))} may"
                                if allowed else f"no {key} may"))
        if not re.fullmatch(rf"[-@:+!]*(/{_COMPONENT})+( [^\s].*)?", value):
            raise ValueError(f"{value!r} is not an absolute command path with arguments")
        if ";" in value.split():  # older systemd starts another command line after a lone `;`
            raise ValueError(f"{value!r}: one command per setting (no ';' word)")
        return value

    return Annotated[str, AfterValidator(check)]


_BOOL = r"yes|no|true|false|on|off|1|0"
Bool = _setting(_BOOL, "yes or no")
Seconds = _setting(r"infinity|([0-9]+(\.[0-9]+)?(us|ms|s|sec|min|m|h|hr|d)? ?)+",
                   "a systemd time span (e.g. 3600, 5min)")
Bytes = _setting(r"infinity|[0-9]+[KMGTPE]?|[0-9]+(\.[0-9]+)?%", "a size (e.g. 16G)")
Limit = _setting(r"(infinity|[0-9]+[KMGTPE]?)(:(infinity|[0-9]+[KMGTPE]?))?",
                 "a resource limit (e.g. 65536, infinity)")
Words = _setting(r"~?[@A-Za-z0-9_:.-]+( [@A-Za-z0-9_:.-]+)*", "a list of names")
# The service user's own home only ({service_home}, filled in by donorkit.fleet): a path bound
# or made writable elsewhere would hand the engine (or a setuid program it runs) the box.
HomePaths = _setting(r"-?\{service_home\}(/[A-Za-z0-9._+@=,~-]+)*"
                     r"( -?\{service_home\}(/[A-Za-z0-9._+@=,~-]+)*)*",
                     "paths under {service_home} (space-separated, '-' prefix allowed)")
HomeBinds = _setting(r"-?\{service_home\}(/[A-Za-z0-9._+@=,~-]+)*"
                     r"(:\{service_home\}(/[A-Za-z0-9._+@=,~-]+)*)?"
                     r"( -?\{service_home\}(/[A-Za-z0-9._+@=,~-]+)*"
                     r"(:\{service_home\}(/[A-Za-z0-9._+@=,~-]+)*)?)*",
                     "binds within {service_home}")
# Hiding or read-only paths take away, never give: any absolute path (or the home) will do.
Paths = _setting(r"-?(\{service_home\}|/)[A-Za-z0-9._+@=,~/-]*"
                 r"( -?(\{service_home\}|/)[A-Za-z0-9._+@=,~/-]*)*", "absolute paths")


class UnitService(Strict):
    """unit_service: the [Service] settings a vLLM unit may take, each with the values it may
    hold. An allow-list: what is not here (SupplementaryGroups, Group, LoadCredential,
    StandardOutput=file:, RuntimeDirectory, PermissionsStartOnly, RootDirectory, ...) is refused,
    as is anything that grants what an ordinary user does not have (capabilities, a negative
    Nice, OOMScoreAdjust -1000, `+`/`!` commands other than PRIVILEGED_EXEC's, paths made
    writable or bound outside the service user's home). User=, ExecStart= and Environment= are
    the template's (from service_user, the model and unit_environment)."""

    # The seed's limits.
    TimeoutStartSec: Seconds = None
    TimeoutStopSec: Seconds = None
    TimeoutSec: Seconds = None
    RestartSec: Seconds = None
    RuntimeMaxSec: Seconds = None
    WatchdogSec: Seconds = None
    Restart: _setting("no|always|on-success|on-failure|on-abnormal|on-abort|on-watchdog",
                      "a Restart= value") = None
    KillMode: _setting("control-group|mixed|process", "control-group, mixed or process") = None
    KillSignal: _setting(r"SIG[A-Z0-9+]+", "a signal name") = None
    SuccessExitStatus: Words = None
    RestartPreventExitStatus: Words = None
    MemoryMax: Bytes = None
    MemoryHigh: Bytes = None
    MemorySwapMax: Bytes = None
    TasksMax: Bytes = None
    CPUQuota: _setting(r"[0-9]+%", "a percentage") = None
    CPUWeight: _setting(r"idle|[0-9]+", "a weight") = None
    IOWeight: _setting(r"[0-9]+", "a weight") = None
    AllowedCPUs: _setting(r"[0-9,-]+( [0-9,-]+)*", "a CPU list") = None
    CPUAffinity: _setting(r"[0-9,-]+( [0-9,-]+)*", "a CPU list") = None
    LimitNOFILE: Limit = None
    LimitMEMLOCK: Limit = None
    LimitCORE: Limit = None
    LimitNPROC: Limit = None
    LimitSTACK: Limit = None
    # Never above the box's own services (sshd): the kernel may kill the engine, not them.
    OOMScoreAdjust: _setting(r"-?([0-9]|[1-9][0-9]{1,2})|1000",
                             "-999 to 1000 (-1000: never killed, before sshd itself)") = None
    Nice: _setting(r"[0-9]|1[0-9]", "0 to 19 (never above other processes)") = None
    # Commands: as the service user, in the sandbox; `+`/`!` only as PRIVILEGED_EXEC says.
    ExecStartPre: _exec("ExecStartPre") = None
    ExecStartPost: _exec("ExecStartPost") = None
    ExecCondition: _exec("ExecCondition") = None
    ExecStop: _exec("ExecStop") = None
    ExecStopPost: _exec("ExecStopPost") = None
    ExecReload: _exec("ExecReload") = None
    # The sandbox.
    NoNewPrivileges: Bool = None
    PrivateTmp: Bool = None
    PrivateDevices: Bool = None
    PrivateNetwork: Bool = None
    PrivateUsers: Bool = None
    PrivateIPC: Bool = None
    PrivateMounts: Bool = None
    ProtectSystem: _setting(rf"{_BOOL}|full|strict", "yes, no, full or strict") = None
    ProtectHome: _setting(rf"{_BOOL}|read-only|tmpfs", "yes, no, read-only or tmpfs") = None
    ProtectProc: _setting("noaccess|invisible|ptraceable|default", "a ProtectProc= value") = None
    ProcSubset: _setting("all|pid", "all or pid") = None
    ReadWritePaths: HomePaths = None
    BindPaths: HomeBinds = None
    ReadOnlyPaths: Paths = None
    InaccessiblePaths: Paths = None
    NoExecPaths: Paths = None
    ProtectKernelTunables: Bool = None
    ProtectKernelModules: Bool = None
    ProtectKernelLogs: Bool = None
    ProtectControlGroups: Bool = None
    ProtectClock: Bool = None
    ProtectHostname: Bool = None
    RestrictNamespaces: _setting(rf"{_BOOL}|~?[a-z]+( [a-z]+)*", "yes, no or namespaces") = None
    RestrictSUIDSGID: Bool = None
    RestrictRealtime: Bool = None
    LockPersonality: Bool = None
    MemoryDenyWriteExecute: Bool = None
    RemoveIPC: Bool = None
    # Capabilities may only be dropped: the ambient set (which grants them) stays empty.
    CapabilityBoundingSet: _setting(r"(~?CAP_[A-Z_]+( CAP_[A-Z_]+)*)?", "capability names") \
        = None
    AmbientCapabilities: _setting("", "empty (an ambient capability is a privilege)") = None
    SystemCallArchitectures: Words = None
    SystemCallFilter: Words = None
    SystemCallErrorNumber: _setting(r"[A-Z0-9]+|kill|log", "an errno name") = None
    RestrictAddressFamilies: _setting(r"none|~?AF_[A-Z0-9]+( AF_[A-Z0-9]+)*",
                                      "address families") = None
    IPAddressAllow: _setting(r"[A-Za-z0-9.:/-]+( [A-Za-z0-9.:/-]+)*", "addresses") = None
    IPAddressDeny: _setting(r"[A-Za-z0-9.:/-]+( [A-Za-z0-9.:/-]+)*", "addresses") = None
    UMask: _setting(r"0?[0-7]{3}", "an octal mask") = None
    # Logging: to the journal (a file: here would be opened by PID 1, as root).
    StandardOutput: _setting("journal|journal\\+console|kmsg|null|inherit", "journal, null, "
                             "kmsg or inherit") = None
    StandardError: _setting("journal|journal\\+console|kmsg|null|inherit", "journal, null, "
                            "kmsg or inherit") = None
    SyslogIdentifier: _setting(r"[A-Za-z0-9._-]+", "a name") = None
    LogLevelMax: _setting(r"[a-z]+|[0-7]", "a log level") = None


# Read by the dynamic loader of every command the unit starts, the root-run `+` ExecStartPre
# included: in a unit's environment they would run the engine's files as root.
UnitEnvName = Annotated[str, _matching(r"(?!LD_)[A-Za-z_][A-Za-z0-9_]*",
                                       "an environment variable name, not LD_* (read by the "
                                       "loader of the root-run ExecStartPre too)")]

# ------------------------------------------------------------------ the models ----------------


# `make accept` (donorkit/accept.py): the workload, the tolerance, and per card its baseline.
PositiveInt = Annotated[int, Field(ge=1)]


class Workload(Strict):
    """What is sent to each donor (sizes in the served model's tokens)."""

    decode_max_tokens: PositiveInt             # tokens generated by the streaming chat request
    prefill_prompt_tokens: PositiveInt         # the long prompt of the prefill measurement
    concurrent_prompts: PositiveInt            # how many long prompts are sent at once
    concurrent_prompt_tokens: PositiveInt      # size of each of them
    concurrent_max_tokens: PositiveInt         # tokens generated for each of them
    request_timeout_s: Annotated[float, Field(gt=0)]


class WorkloadOverride(Strict):
    decode_max_tokens: PositiveInt | None = None
    prefill_prompt_tokens: PositiveInt | None = None
    concurrent_prompts: PositiveInt | None = None
    concurrent_prompt_tokens: PositiveInt | None = None
    concurrent_max_tokens: PositiveInt | None = None
    request_timeout_s: Annotated[float, Field(gt=0)] | None = None


class Baseline(Strict):
    """A card's reference figures; a figure left out is recorded, not compared."""

    prefill_tok_s: Annotated[float, Field(gt=0)] | None = None
    decode_tok_s: Annotated[float, Field(gt=0)] | None = None
    ttft_s: Annotated[float, Field(gt=0)] | None = None
    concurrent_wall_s: Annotated[float, Field(gt=0)] | None = None
    source: str = ""                            # where the figures come from


class CardAcceptance(Strict):
    """A card profile's `acceptance` block."""

    baseline: Baseline = Baseline()
    compare_figures: bool = True                # False: figures recorded, never compared
    tool_calls_required: bool = True            # False: fidelity reported, not required
    forced_tool_call_check: bool = False        # also force one call's text: proves the parser
    reason: str = ""                            # why figures/tool calls are not held to account
    workload: WorkloadOverride = WorkloadOverride()


class AcceptanceSettings(Strict):
    """defaults.yml `acceptance`: the workload and the tolerance every card shares."""

    workload: Workload
    tolerance: Annotated[float, Field(ge=0, lt=1)]   # fraction worse than baseline still passing
    results_dir: str                                  # relative to the repo root


class Card(Strict):
    """A card profile (defaults.yml `cards:`): a new card is a new entry.

    `engine: cpu` is vLLM's CPU build (the testbed's real-engine host): no GPU, no CUDA toolkit,
    no exllamav3 or plugin; its venv is `packages` plus the pinned `requirements_file`, all
    installed with --no-deps (the file says which of vLLM's requirements are left out, and why)."""

    engine: Literal["cuda", "cpu"] = "cuda"
    gpu_name: Text | None = None            # what nvidia-smi reports (cuda engine)
    arch: Arch | None = None                # compute capability, "8.9" (cuda engine)
    cuda: CudaVersion | None = None         # toolkit under /usr/local/cuda-<cuda> (cuda engine)
    pip_index_url: Url                      # where pip finds this CUDA variant of torch/vLLM
    pip_extra_index_urls: list[Url]
    vllm_variant: VllmVariant | None = None  # vLLM's CUDA-variant build (cu129), if any
    pip_index_strategy: Literal["first-index", "unsafe-first-match",
                                "unsafe-best-match"] | None = None  # uv's, several indexes
    pip_find_links: list[Url] = []          # pip --find-links pages (cpu engine: torch's build)
    pip_trusted_hosts: list[SshHost] = []   # hosts (name or IP) pip may use over plain http
    packages: list[PipRequirement] = []     # cpu engine: vLLM and torch as pinned requirements
    requirements_file: LocalPath | None = None  # cpu engine: every other distribution, pinned
    acceptance: CardAcceptance = CardAcceptance()  # baseline and policy for `make accept`
    vllm_args: list[ModelArg] = []          # flags this card adds to every model's vllm serve


# vLLM 0.26.0 refuses this variable at engine start for a model with neither sliding-window nor
# Mamba (linear-attention) layers, and when it is not a multiple of the scheduler block size
# (vllm/v1/core/kv_cache_coordinator.py, _validate_prefix_cache_retention_interval): it belongs to
# the model profiles whose checkpoint has such layers, never to every unit.
RETENTION = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
RETENTION_BLOCK = 16  # vLLM's default KV block size on CUDA (--block-size)


def _no_file_wide_retention(env: dict[str, str]) -> dict[str, str]:
    if RETENTION in env:
        raise ValueError(f"{RETENTION} belongs in models.<name>.environment of a model with "
                         "sliding-window or Mamba layers: vLLM 0.26.0 refuses to start any other "
                         "model with it (a full-attention model such as Hermes never starts)")
    return env


def _retention_multiple(env: dict[str, str]) -> dict[str, str]:
    value = env.get(RETENTION)
    if value is not None and not (value.isdigit() and int(value) % RETENTION_BLOCK == 0):
        raise ValueError(f"{RETENTION} must be a whole number of tokens, a multiple of the KV "
                         f"block size {RETENTION_BLOCK} (vLLM refuses it otherwise), not {value!r}")
    return env


class Model(Strict):
    """A model identity (defaults.yml `models:`): one loopback port each."""

    checkpoint: Checkpoint
    port: Port
    max_model_len: Annotated[int, Field(ge=1)]
    args: list[ModelArg]                    # vllm serve flags; never host/port/alias/config
    environment: Annotated[dict[UnitEnvName, Text], AfterValidator(_retention_multiple)]
    revision: Commit | None = None          # the checkpoint's commit; None: not pinned yet


class PluginPath(Strict):
    path: LocalPath                         # the plugin's directory on the operator's machine


class PluginGit(Strict):
    git_url: GitUrl
    ref: GitRef


class RateLimit(Strict):
    """caddy-ratelimit's zone for one public hostname: `events` per `window` per `key` (one of
    SERVER_KNOWN_KEYS: the client's address, never something the client sends)."""

    events: Annotated[int, Field(ge=1)]
    window: Duration
    key: Annotated[Placeholder, AfterValidator(_server_known)]


class EdgeProxy(Strict):
    """How an edge spreads one hostname over its donors (defaults.yml `edge_proxy:`)."""

    lb_policy: Literal["round_robin", "least_conn", "random", "first"]
    lb_try_duration: DurationOrZero
    lb_try_interval: DurationOrZero
    health_uri: UriPath
    health_interval: Duration
    health_timeout: Duration


class Defaults(Strict):
    """defaults.yml, and what a donor's merged overrides must still be."""

    supported_distros: list[Distro]
    require_nvidia_smi: bool
    cuda_driver_minimums: dict[CudaVersion, DriverVersion]  # oldest driver each CUDA runs on
    apt_lock_wait: Annotated[int, Field(ge=0, le=86400)]  # seconds apt steps wait for locks
    cuda_repo_url: UrlTemplate
    cuda_keyring_deb: FileName
    cuda_keyring_path: AbsPath
    build_packages: list[DebPackage]
    service_user: Annotated[UserName, AfterValidator(_not_root)]  # vLLM never runs as root
    install_root: Annotated[AbsPath, AfterValidator(_install_root)]
    venv_dir: AbsPath                       # under install_root (check_paths)
    venv_python: Executable
    vllm_version: Version
    torch_version: Version
    vllm_variant_index_url: WheelUrlTemplate
    uv_version: Version
    venv_build_packages: list[PipRequirement]
    vllm_executable: ExecutableTemplate
    exllamav3_git_url: GitUrl
    exllamav3_ref: GitRef
    exllamav3_version: Version
    exllamav3_gib_per_job: Annotated[float, Field(gt=0, le=1024)]
    exllamav3_patches: list[LocalPath]
    exllamav3_wheel_cache: LocalPath
    vllm_exl3_plugin: PluginPath | PluginGit
    vllm_exl3_plugin_dir: AbsPath           # under install_root (check_paths)
    vllm_exl3_plugin_dist: Annotated[str, _matching(r"[A-Za-z0-9][A-Za-z0-9._-]*",
                                                    "a distribution name")]
    unit_environment: Annotated[dict[UnitEnvName, Text],
                                AfterValidator(_no_file_wide_retention)]
    unit_service: UnitService     # an allow-list: see UnitService
    cards: dict[Name, Card]
    models: dict[Name, Model]
    caddy_source: Literal["distro", "upstream"]
    caddy_upstream_repo_url: Url
    caddy_upstream_key_url: Url
    caddy_https_port: Port
    # caddy.service's own runtime directory (its drop-in creates it, and removes it on stop).
    caddy_admin_socket: Annotated[str, _matching(r"/run/caddy/[a-z0-9][a-z0-9.-]*",
                                                 "/run/caddy/<socket>, Caddy's own runtime "
                                                 "directory")]
    caddy_dial_timeout: Duration
    caddy_response_header_timeout: Duration
    caddy_log_scrubbed_headers: list[HeaderName]
    caddy_access_log: Annotated[AbsPath, under("/var/log/caddy", "chowned to caddy")]
    caddy_tls_dir: Annotated[AbsPath, under("/etc/caddy", "chmod 750, group caddy")]
    pki_dir: LocalPath
    pki_renew_days: Annotated[int, Field(ge=1, le=300)]
    hf_endpoint_plain_http_test_standin: bool = False  # http:// allowed: a test stand-in only
    hf_endpoint: Url                        # the Hugging Face hub (or a mirror of its API)
    hf_token_file: LocalPath | None         # gated checkpoints' token (operator's machine)
    ready_timeout: Annotated[int, Field(ge=1, le=86400)]      # seconds the gate waits
    ready_journal_lines: Annotated[int, Field(ge=1, le=1000)]  # shown when not ready
    rollout_batch_size: Annotated[int, Field(ge=1, le=1000)]   # boxes at a time
    rollout_in_service_timeout: Annotated[int, Field(ge=1, le=86400)]
    edge_rate_limit: RateLimit | None
    edge_public_tls: Literal["acme", "private_ca"]
    edge_https_port: Port
    edge_proxy: EdgeProxy
    acceptance: AcceptanceSettings           # `make accept`: workload, tolerance, results

    @field_validator("venv_dir", "vllm_exl3_plugin_dir")
    @classmethod
    def _under_install_root(cls, value: str, info: ValidationInfo) -> str:
        """What the deploy creates lies under the root it owns (install_root)."""
        root = info.data.get("install_root")
        if root and not value.startswith(f"{root}/"):
            raise ValueError(f"{value!r} is not under install_root ({root}/)")
        return value


    @field_validator("hf_endpoint")
    @classmethod
    def _hub_over_https(cls, url: str, info: ValidationInfo) -> str:
        if url.startswith("http://") and not info.data.get("hf_endpoint_plain_http_test_standin"):
            raise ValueError(f"{url!r} is plain http: the hub is https (a test stand-in of the "
                             "hub may say hf_endpoint_plain_http_test_standin: true)")
        return url

    @field_validator("hf_token_file")
    @classmethod
    def _no_token_in_clear(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path is not None and info.data.get("hf_endpoint", "").startswith("http://"):
            raise ValueError("the token would cross the network in clear: hf_endpoint is plain "
                             "http (use an https endpoint)")
        return path


class Donor(Strict):
    """One entry of donors.yml `donors:`."""

    ssh_host: SshHost                       # what pyinfra connects to
    ssh_user: UserName                      # not root: sudo is used
    ssh_port: Port = 22
    ssh_key: LocalPath | None = None        # private key on the operator's machine
    ssh_known_hosts_file: LocalPath | None = None
    card: Name                              # a key of defaults.yml `cards:`
    routes: Annotated[dict[Hostname, Name], Field(min_length=1)]  # public hostname -> model
    overrides: dict[str, Any] = {}          # any defaults.yml key; validated after merging


class Edge(Strict):
    """One entry of donors.yml `edges:`: a front door that proxies public hostnames to donors."""

    ssh_host: SshHost
    ssh_user: UserName
    ssh_port: Port = 22
    ssh_key: LocalPath | None = None
    ssh_known_hosts_file: LocalPath | None = None
    hostnames: Literal["all"] | Annotated[list[Hostname], Field(min_length=1)]
    caddy_source: Literal["distro", "upstream"] | None = None   # None: defaults.yml's
    # Absent: defaults.yml's edge_rate_limit; null: no rate limit on this edge.
    rate_limit: RateLimit | None = None
    public_tls: Literal["acme", "private_ca"] | None = None   # None: defaults.yml's
    overrides: dict[str, Any] = {}


class Inventory(Strict):
    """A donors file: the donors, the edges in front of them, file-wide overrides."""

    donors: Annotated[dict[Name, dict[str, Any]], Field(min_length=1)]
    edges: dict[Name, dict[str, Any]] = {}
    overrides: dict[str, Any] = {}


# Keys whose value is replaced whole by an override, not merged (it has alternative shapes).
REPLACED_WHOLE = {"vllm_exl3_plugin"}


def deep_merge(base: dict, override: dict, top: bool = True) -> dict:
    """`override` onto `base`: mappings merge key by key at every depth; anything else (lists,
    scalars, a mapping over a non-mapping) replaces."""
    merged = dict(base)
    for key, value in override.items():
        if (isinstance(value, dict) and isinstance(base.get(key), dict)
                and not (top and key in REPLACED_WHOLE)):
            merged[key] = deep_merge(base[key], value, top=False)
        else:
            merged[key] = value
    return merged


def variant_cuda(variant: str | None) -> str | None:
    """The CUDA version a build variant runs: cu129 -> 12.9, cu130 -> 13.0."""
    return f"{variant[2:-1]}.{variant[-1]}" if variant else None


def check_driver_minimums(defaults: Defaults, cards: list[str]) -> tuple[str, str] | None:
    """Each of these cards' CUDA version has a driver minimum (the preflight compares with it)."""
    for name in cards:
        card = defaults.cards[name]
        if card.engine == "cpu":
            if card.cuda or card.gpu_name or card.arch or card.vllm_variant or not card.packages \
                    or not card.requirements_file:
                return f"cards.{name}", ("a cpu engine has packages and requirements_file, and "
                                         "no gpu_name, arch, cuda or vllm_variant")
            continue
        missing = [f for f in ("gpu_name", "arch", "cuda") if getattr(card, f) is None]
        if missing or card.packages or card.requirements_file:
            return f"cards.{name}", ("a cuda engine needs gpu_name, arch and cuda, and takes no "
                                     "packages or requirements_file")
        for field, cuda in (("cuda", card.cuda), ("vllm_variant", variant_cuda(card.vllm_variant))):
            if cuda and cuda not in defaults.cuda_driver_minimums:
                return f"cards.{name}.{field}", (f"CUDA {cuda} has no driver minimum (a version "
                                                 "like 580.65.06) under cuda_driver_minimums")
    return None


def check_box(defaults: Defaults, donor: Donor) -> tuple[str, str] | None:
    """Cross-checks of one box once merged: (field, problem), or None when it is sound."""
    if defaults.service_user == donor.ssh_user:
        return "service_user", (f"'{donor.ssh_user}' is also this box's ssh_user: the deploy "
                                "would set the login user's shell to nologin")
    if donor.card not in defaults.cards:
        return "card", (f"unknown card '{donor.card}' "
                        f"(known: {', '.join(sorted(defaults.cards))})")
    problem = check_driver_minimums(defaults, [donor.card])
    if problem:
        return problem
    for hostname, model in donor.routes.items():
        if model not in defaults.models:
            return f"routes.{hostname}", (f"unknown model identity '{model}' "
                                          f"(known: {', '.join(sorted(defaults.models))})")
    ports: dict[int, str] = {defaults.caddy_https_port: "caddy_https_port"}
    for model in sorted(set(donor.routes.values())):
        port = defaults.models[model].port
        if port in ports:
            return f"models.{model}.port", f"port {port} is also {ports[port]} on this box"
        ports[port] = f"models.{model}.port"
    return None
