"""The [Service] settings a model unit may take (`unit_service` in defaults.yml): an allow-list,
`UnitService`, with the systemd words each setting may hold (donorkit/inventory/schema.py uses
it)."""


import re
from typing import Annotated, Any

from pydantic import AfterValidator

from donorkit.inventory.values import COMPONENT, Strict, matching, no_control


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
        no_control(text)
        if re.search(r"[0-9]{19}", text):  # past systemd's 64-bit values: it would ignore the line
            raise ValueError(f"{text!r}: a number of 19 digits or more is out of range")
        if not compiled.fullmatch(text):
            raise ValueError(f"{text!r} is not {what}")
        return value

    return Annotated[str | int | bool, AfterValidator(check)]


# The only commands that may run with full privileges (`+`, `!`, `!!` prefixes), per key: the
# defaults' own. Anything else in an Exec setting runs as the service user, in its sandbox.
PRIVILEGED_EXEC = {"ExecStartPre": ("-+/usr/bin/nvidia-modprobe -u -c=0",)}


def _exec(key: str) -> Any:
    def check(value: str) -> str:
        no_control(value)
        prefix = re.match(r"[-@:+!]*", value)[0]
        if ("+" in prefix or "!" in prefix) and value not in PRIVILEGED_EXEC.get(key, ()):
            allowed = PRIVILEGED_EXEC.get(key)
            raise ValueError(f"{value!r}: '+' and '!' run a command with full privileges; "
                             + (f"only {' or '.join(map(repr, allowed))} may"
                                if allowed else f"no {key} may"))
        if not re.fullmatch(rf"[-@:+!]*(/{COMPONENT})+( [^\s].*)?", value):
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
# The service user's own home only ({service_home}, filled in by donorkit.inventory.fleet): a path
# bound or made writable elsewhere would hand the engine (or a setuid program it runs) the box.
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
UnitEnvName = Annotated[str, matching(r"(?!LD_)[A-Za-z_][A-Za-z0-9_]*",
                                       "an environment variable name, not LD_* (read by the "
                                       "loader of the root-run ExecStartPre too)")]

