"""The inventory's value types (donorkit/inventory/schema.py's models are built of them): one rule
for every string (no control characters, nothing that would hand the box away), absolute paths and
the folders they must be under, SSH addresses and one box's identity, Caddy durations (parsed
once: `duration_ns`), package requirements, vLLM arguments, and `Strict`, every section's base."""


import ipaddress
import math
import re
import socket
import unicodedata
from typing import Annotated, Any

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# ------------------------------------------------------------------ value types --------------


# Characters no inventory string may hold, wherever it lands: control characters (a newline
# writes its own unit or Caddyfile line), format characters (bidi overrides, zero-width: what is
# shown is not what is written), line and paragraph separators, surrogates and private use.
_REFUSED_CATEGORIES = {"Cc": "control", "Cf": "format", "Zl": "line separator",
                       "Zp": "paragraph separator", "Cs": "surrogate", "Co": "private use"}


def no_control(text: str) -> str:
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
    rule of no_control: (its path, the problem), or None. donorkit.inventory.fleet runs it on each
    file before validating anything, so no field, known or not, is exempt."""
    if isinstance(node, str):
        try:
            no_control(node)
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


def matching(pattern: str, what: str) -> AfterValidator:
    compiled = re.compile(pattern)

    def check(text: str) -> str:
        if not compiled.fullmatch(text):
            raise ValueError(f"{text!r} is not {what}")
        return text

    return AfterValidator(check)


Text = Annotated[str, AfterValidator(no_control)]
"""Any string without control characters (quoted wherever it is written)."""

Name = Annotated[str, Field(max_length=63),
                 matching(r"[a-z0-9][a-z0-9-]*", "a name (lowercase letters, digits, '-'; "
                                                  "not starting with '-')")]
"""Donor names, card profiles and model identities: they become file and unit names."""


# One path component: letters, digits and `._+@=,~-` (no whitespace, quotes, braces, `$`, `%`,
# `;`, `#`: nothing a shell, a unit or a Caddyfile reads as syntax).
COMPONENT = r"[A-Za-z0-9._+@=,~-]+"


def _abs_path(text: str) -> str:
    if not re.fullmatch(rf"(/{COMPONENT})+|/", text) or \
            any(part in (".", "..") for part in text.split("/")):
        raise ValueError(f"{text!r} is not an absolute path of letters, digits and '._+@=,~-' "
                         "(no whitespace, quotes, braces, '.' or '..')")
    return text


AbsPath = Annotated[str, AfterValidator(no_control), AfterValidator(_abs_path)]
"""A path on the box: absolute, plain characters only, no `.` or `..` components."""


def under(root: str, what: str) -> AfterValidator:
    """An AbsPath strictly below `root` (the directory its service owns)."""
    def check(text: str) -> str:
        if not text.startswith(f"{root}/"):
            raise ValueError(f"{text!r} is not under {root}/ ({what})")
        return text

    return AfterValidator(check)


def valid_install_root(text: str) -> str:
    if not re.fullmatch(rf"/(opt|srv)/{COMPONENT}(/{COMPONENT})*", text):
        raise ValueError(f"{text!r} is not a directory of the deploy's own under /opt/ or /srv/ "
                         "(it is created and chowned root: never a system directory)")
    return text


LocalPath = Annotated[str, Field(min_length=1), AfterValidator(no_control),
                      matching(r"[A-Za-z0-9._+@=,~/-]+", "a path of letters, digits and "
                                                         "'._+@=,~/-' (no whitespace or quotes)")]
"""A path on the operator's machine; relative paths are relative to the repository root."""

UserName = Annotated[str, matching(r"[a-z_][a-z0-9_-]{0,31}",
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


def not_root(text: str) -> str:
    if text == "root":
        raise ValueError("the service must not run as root")
    if text in RESERVED_USERS or text.startswith("systemd-"):
        raise ValueError(f"{text!r} is a system account or group of the box (caddy, root, "
                         "sshd, ...): the service user is vLLM's own")
    return text


Port = Annotated[int, Field(ge=1, le=65535)]


def _not_http_port(port: int) -> int:
    if port == 80:
        raise ValueError("80 is Caddy's plain-HTTP port (a site there gets no TLS, and an ACME "
                         "edge answers its challenges there)")
    return port


CaddyTlsPort = Annotated[int, Field(ge=1, le=65535), AfterValidator(_not_http_port)]
"""The port of a Caddy TLS site (a donor's caddy_https_port, an edge's edge_https_port)."""
Hostname = Annotated[str, Field(max_length=253), matching(
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


SshHost = Annotated[str, AfterValidator(no_control), AfterValidator(_ssh_host)]
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

def _url_authority(text: str) -> str:
    """A URL's host and port, past its pattern: the port 1-65535 (written without leading
    zeros), the host a DNS name of valid labels or an IPv4 address of one box that is neither
    link-local (169.254.169.254, the cloud metadata service, would be handed the request and
    any token with it) nor multicast, broadcast or unspecified. `file:///` has neither."""
    found = re.match(r"[a-z+]+://([^/]*)", text)
    if not found or not found.group(1):
        return text
    host, sep, port = found.group(1).rpartition("@")[2].partition(":")
    if sep and not (port.isdigit() and port == str(int(port)) and 1 <= int(port) <= 65535):
        raise ValueError(f"{text!r}: port {port!r} is not a port (1-65535)")
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        address = None
    if address is not None:
        if address.is_link_local or address.is_multicast or address.is_unspecified \
                or address == ipaddress.IPv4Address("255.255.255.255"):
            raise ValueError(f"{text!r}: {host} is not the address of a server (link-local, "
                             "multicast, broadcast or unspecified)")
        return text
    if len(host) > 253 or not re.fullmatch(rf"{_LABEL}(\.{_LABEL})*\.?", host):
        raise ValueError(f"{text!r}: {host!r} is not a hostname (labels of letters, digits and "
                         "'-', not starting or ending with '-') or an IPv4 address")
    try:  # 127.1, 0x7f.0.0.1: the resolver reads them as IPv4 addresses
        socket.inet_aton(host)
    except OSError:
        return text
    raise ValueError(f"{text!r}: {host!r} is another spelling of an IPv4 address: write it as "
                     "a.b.c.d")


UrlHostPort = AfterValidator(_url_authority)
Url = Annotated[str, matching(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~%+/-]*)?",
                               "an http(s) URL (host, optional port and path; no query)"),
                UrlHostPort]
GitUrl = Annotated[str, matching(
    r"(https?|git|ssh)://[A-Za-z0-9.@:-]+(/[A-Za-z0-9._~%+/-]*)?|file:///[A-Za-z0-9._~%+/-]+",
    "a git URL (http(s)://, git://, ssh:// or file:///; no query)"), UrlHostPort]
UrlTemplate = Annotated[str, matching(
    r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/([A-Za-z0-9._~%+/-]|\{distro\})*)?",
    "an http(s) URL (may contain {distro})"), UrlHostPort]
GitRef = Annotated[str, Field(max_length=200),
                   matching(r"[A-Za-z0-9][A-Za-z0-9._/+-]*", "a git tag, branch or commit")]
Version = Annotated[str, matching(r"[0-9][0-9A-Za-z.+-]*", "a version (e.g. 0.26.0)")]
DriverVersion = Annotated[str, matching(r"[0-9]+(\.[0-9]+)*", "an NVIDIA driver version "
                                                               "(e.g. 580.65.06)")]
VllmVariant = Annotated[str, matching(r"cu[0-9]{3}", "a CUDA variant like cu129")]
WheelUrlTemplate = Annotated[str, matching(
    r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/([A-Za-z0-9._~%+/-]|\{version\}|\{variant\})*)?",
    "an http(s) URL (may contain {version} and {variant})"), UrlHostPort]
Arch = Annotated[str, matching(r"[0-9]+\.[0-9]+", "a compute capability MAJOR.MINOR")]
CudaVersion = Annotated[str, matching(r"[0-9]+\.[0-9]+", "a CUDA version MAJOR.MINOR")]
DebPackage = Annotated[str, matching(r"[a-z0-9][a-z0-9+.-]+", "a Debian package name")]
Distro = Annotated[str, matching(r"[a-z]+[0-9]+", "<ID><VERSION_ID without dots>")]
FileName = Annotated[str, matching(r"[A-Za-z0-9][A-Za-z0-9._+-]*", "a file name")]
EnvName = Annotated[str, matching(r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable name")]
HeaderName = Annotated[str, matching(r"[A-Za-z0-9][A-Za-z0-9-]*", "an HTTP header name")]
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
Placeholder = Annotated[str, matching(r"\{[a-z][A-Za-z0-9_.>-]*\}",
                                       "a Caddy placeholder (e.g. {remote_host})")]


def server_known(text: str) -> str:
    if text not in SERVER_KNOWN_KEYS:
        raise ValueError(f"{text!r} is chosen by the client or not known per connection: use "
                         f"one of {', '.join(SERVER_KNOWN_KEYS)}")
    return text
UriPath = Annotated[str, matching(r"/[A-Za-z0-9._~/-]*", "a URI path (e.g. /v1/models)")]
Executable = Annotated[str, matching(rf"[A-Za-z0-9._+-]+|(/{COMPONENT})+",
                                      "a command name or an absolute path")]
ExecutableTemplate = Annotated[str, AfterValidator(no_control),
                               matching(rf"(\{{venv_dir\}})?(/{COMPONENT})+",
                                         "an absolute path (may start with {venv_dir})")]
Commit = Annotated[str, matching(r"[0-9a-f]{40}", "a commit hash (40 lowercase hex digits)")]
"""A checkpoint's pinned revision: a full commit hash, never a branch or a tag that can move."""

Checkpoint = Annotated[str, AfterValidator(no_control), matching(
    rf"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?|(/{COMPONENT})+",
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
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    if isinstance(value, int) and not -2**63 <= value < 2**63:
        raise ValueError(f"{value} is out of range (a 64-bit integer)")
    text = str(value)
    no_control(text)
    owned = owned_option(text)
    if owned:
        raise ValueError(f"{text!r} would set {owned}, which the deploy owns "
                         "(--host 127.0.0.1, the model's port, no alias, no config file)")
    return text


ModelArg = Annotated[str | int | float, AfterValidator(_model_arg)]


class Strict(BaseModel):
    """Every section: strict types, unknown keys refused."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    def to_json(self) -> Any:
        """pyinfra's CLI shows host data as JSON (`debug-inventory`): it asks this method of each
        value it cannot write itself (the typed host data, donorkit/inventory/host_data.py, is made
        of these models)."""
        return self.model_dump(mode="json")
