"""The inventory's schema: every key of defaults.yml, of a donor entry and of `overrides`, with its
type, shape and range, in one place. Read this file as the reference of what the data may say.

Validated with pydantic v2 (already installed as a dependency of pyinfra; pinned in
requirements.txt): strict types (`"30"` is not an int, `Api-Key` is not a list), unknown keys
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
import unicodedata
from typing import Annotated, Any, Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# ------------------------------------------------------------------ value types --------------


def _no_control(text: str) -> str:
    """No control characters anywhere (a newline in a value would write its own unit or Caddyfile
    line); every string of the inventory goes through this."""
    for char in text:
        if unicodedata.category(char) == "Cc":
            raise ValueError(f"control character {char!r} is not allowed")
    return text


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


def _abs_path(text: str) -> str:
    if not text.startswith("/") or any(c.isspace() for c in text) or "/../" in f"{text}/":
        raise ValueError(f"{text!r} is not an absolute path without whitespace or '..'")
    return text


AbsPath = Annotated[str, AfterValidator(_no_control), AfterValidator(_abs_path)]
"""A path on the box: absolute, no whitespace, no control characters, no `..`."""

LocalPath = Annotated[str, Field(min_length=1), AfterValidator(_no_control),
                      _matching(r"[^\s]+", "a path without whitespace")]
"""A path on the operator's machine; relative paths are relative to the repository root."""

UserName = Annotated[str, _matching(r"[a-z_][a-z0-9_-]{0,31}",
                                    "a user name (lowercase, at most 32 characters)")]


def _not_root(text: str) -> str:
    if text == "root":
        raise ValueError("the service must not run as root")
    return text


Port = Annotated[int, Field(ge=1, le=65535)]
Hostname = Annotated[str, Field(max_length=253), _matching(
    r"([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}", "a DNS hostname")]
"""A public hostname (lowercase, fully qualified)."""

_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"


def _ssh_host(text: str) -> str:
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    if len(text) > 253 or not re.fullmatch(rf"{_LABEL}(\.{_LABEL})*\.?", text):
        raise ValueError(f"{text!r} is not a hostname or an IP address")
    return text


SshHost = Annotated[str, AfterValidator(_ssh_host)]
"""What pyinfra connects to: a hostname or an IPv4/IPv6 address (never empty, never `-...`)."""

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
VllmVariant = Annotated[str, _matching(r"cu[0-9]{3}", "a CUDA variant like cu128")]
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
Duration = Annotated[str, _matching(r"([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+",
                                    "a Caddy duration (e.g. 5s, 1260s)")]
Placeholder = Annotated[str, _matching(r"\{[a-z][a-z0-9_.>-]*\}",
                                       "a Caddy placeholder (e.g. {remote_host})")]
UriPath = Annotated[str, _matching(r"/[A-Za-z0-9._~/-]*", "a URI path (e.g. /v1/models)")]
Executable = Annotated[str, _matching(r"[A-Za-z0-9._+-]+|/[^\s]+",
                                      "a command name or an absolute path")]
ExecutableTemplate = Annotated[str, AfterValidator(_no_control),
                               _matching(r"(/|\{venv_dir\}/)[^\s]+",
                                         "an absolute path (may start with {venv_dir})")]
Commit = Annotated[str, _matching(r"[0-9a-f]{40}", "a commit hash (40 lowercase hex digits)")]
"""A checkpoint's pinned revision: a full commit hash, never a branch or a tag that can move."""

Checkpoint = Annotated[str, AfterValidator(_no_control), _matching(
    r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?|/[^\s]+",
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


def _unit_value(value: str | int | bool) -> str | int | bool:
    if isinstance(value, str):
        _no_control(value)
        if value.endswith("\\"):
            raise ValueError("a value ending in '\\' would continue onto the next line")
    return value


UnitValue = Annotated[str | int | bool, AfterValidator(_unit_value)]
# Set by the template from other data: a [Service] key here would contradict it.
TEMPLATE_OWNED_SERVICE_KEYS = {"User", "Group", "DynamicUser", "ExecStart", "Environment",
                               "EnvironmentFile", "Type", "PassEnvironment"}


def _service_key(text: str) -> str:
    if text in TEMPLATE_OWNED_SERVICE_KEYS:
        raise ValueError(f"{text} is set by the unit template, not by unit_service")
    return text


ServiceKey = Annotated[str, _matching(r"[A-Z][A-Za-z0-9]+", "a systemd directive name"),
                       AfterValidator(_service_key)]

# ------------------------------------------------------------------ the models ----------------


class Strict(BaseModel):
    """Every section: strict types, unknown keys refused."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


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
    vllm_variant: VllmVariant | None = None  # vLLM's CUDA-variant release wheel (cu128), if any
    pip_find_links: list[Url] = []          # pip --find-links pages (cpu engine: torch's build)
    pip_trusted_hosts: list[SshHost] = []   # hosts (name or IP) pip may use over plain http
    packages: list[PipRequirement] = []     # cpu engine: vLLM and torch as pinned requirements
    requirements_file: LocalPath | None = None  # cpu engine: every other distribution, pinned
    acceptance: CardAcceptance = CardAcceptance()  # baseline and policy for `make accept`


class Model(Strict):
    """A model identity (defaults.yml `models:`): one loopback port each."""

    checkpoint: Checkpoint
    port: Port
    max_model_len: Annotated[int, Field(ge=1)]
    args: list[ModelArg]                    # vllm serve flags; never host/port/alias/config
    environment: dict[EnvName, Text]
    revision: Commit | None = None          # the checkpoint's commit; None: not pinned yet


class PluginPath(Strict):
    path: LocalPath                         # the plugin's directory on the operator's machine


class PluginGit(Strict):
    git_url: GitUrl
    ref: GitRef


class RateLimit(Strict):
    """caddy-ratelimit's zone for one public hostname: `events` per `window` per `key`."""

    events: Annotated[int, Field(ge=1)]
    window: Duration
    key: Placeholder


class EdgeProxy(Strict):
    """How an edge spreads one hostname over its donors (defaults.yml `edge_proxy:`)."""

    lb_policy: Literal["round_robin", "least_conn", "random", "first"]
    lb_try_duration: Duration
    lb_try_interval: Duration
    health_uri: UriPath
    health_interval: Duration
    health_timeout: Duration
    fail_duration: Duration
    max_fails: Annotated[int, Field(ge=1)]
    unhealthy_status: list[Annotated[int, Field(ge=100, le=599)]]


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
    install_root: AbsPath
    venv_dir: AbsPath
    venv_python: Executable
    vllm_version: Version
    torch_version: Version
    vllm_release_wheel_url: WheelUrlTemplate
    venv_build_packages: list[PipRequirement]
    vllm_executable: ExecutableTemplate
    exllamav3_git_url: GitUrl
    exllamav3_ref: GitRef
    exllamav3_version: Version
    exllamav3_gib_per_job: Annotated[float, Field(gt=0, le=1024)]
    exllamav3_patches: list[LocalPath]
    exllamav3_wheel_cache: LocalPath
    vllm_exl3_plugin: PluginPath | PluginGit
    vllm_exl3_plugin_dir: AbsPath
    vllm_exl3_plugin_dist: Annotated[str, _matching(r"[A-Za-z0-9][A-Za-z0-9._-]*",
                                                    "a distribution name")]
    unit_environment: dict[EnvName, Text]
    unit_service: dict[ServiceKey, UnitValue]
    cards: dict[Name, Card]
    models: dict[Name, Model]
    caddy_source: Literal["distro", "upstream"]
    caddy_upstream_repo_url: Url
    caddy_upstream_key_url: Url
    caddy_https_port: Port
    caddy_admin_socket: Annotated[str, _matching(r"/run/[a-z0-9-]+/[a-z0-9.-]+",
                                                 "/run/<dir>/<socket>")]
    caddy_dial_timeout: Duration
    caddy_response_header_timeout: Duration
    caddy_log_scrubbed_headers: list[HeaderName]
    caddy_access_log: AbsPath
    caddy_tls_dir: AbsPath
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
        cuda = card.cuda
        if cuda not in defaults.cuda_driver_minimums:
            return f"cards.{name}.cuda", (f"CUDA {cuda} has no driver minimum (a version like "
                                          "580.65.06) under cuda_driver_minimums")
    return None


def check_box(defaults: Defaults, donor: Donor) -> tuple[str, str] | None:
    """Cross-checks of one box once merged: (field, problem), or None when it is sound."""
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
