"""The inventory's schema: every key of defaults.yml, of a donor entry and of `overrides`, with its
type, shape and range, in one place. Read this file as the reference of what the data may say.

Validated with pydantic v2 (pinned in pyproject.toml): strict types, unknown keys refused, each
error located by a path (`models.qwen.port`) that donorkit.inventory.fleet turns into one line
naming the file, the donor and the field. A box's effective settings are defaults.yml deep-merged
with the donors file's `overrides:`, then its own, validated again as a `Defaults`
(docs/reference.md "The data files"); donorkit.inventory.fleet does the loading.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, field_validator

from donorkit.inventory.card_profiles import AcceptanceSettings, Card, CudaCard, variant_cuda
from donorkit.inventory.tunnel_values import (
    KeepaliveSeconds,
    TunnelAddress,
    TunnelPool,
    WgInterface,
    WgKey,
)
from donorkit.inventory.unit_settings import UnitEnvName, UnitService
from donorkit.inventory.values import (
    AbsPath,
    CaddyTlsPort,
    Checkpoint,
    Commit,
    CudaVersion,
    DebPackage,
    Distro,
    DriverVersion,
    Duration,
    DurationOrZero,
    Executable,
    ExecutableTemplate,
    FileName,
    GitRef,
    GitUrl,
    HeaderName,
    Hostname,
    LocalPath,
    ModelArg,
    Name,
    PipRequirement,
    Placeholder,
    Port,
    SshHost,
    Strict,
    Text,
    UriPath,
    Url,
    UrlTemplate,
    UserName,
    Version,
    WheelUrlTemplate,
    matching,
    not_root,
    server_known,
    under,
    valid_install_root,
)

# ------------------------------------------------------------------ the models ----------------


# vLLM 0.26.0 refuses this variable at engine start for a model with neither sliding-window nor
# Mamba (linear-attention) layers, and when it is not a multiple of the scheduler block size
# (vllm/v1/core/kv_cache_coordinator.py): it belongs to the model profiles whose checkpoint has
# such layers (a profile's `attention:` says which), never to every unit.
RETENTION = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
RETENTION_BLOCK = 16  # vLLM's default KV block size on CUDA (--block-size)


def _no_file_wide_retention(env: dict[str, str]) -> dict[str, str]:
    if RETENTION in env:
        raise ValueError(f"{RETENTION} belongs in models.<name>.environment of a model with "
                         "sliding-window or Mamba layers: vLLM 0.26.0 refuses to start any other "
                         "model with it (a full-attention model such as Hermes never starts)")
    return env


def _flag(args: list[str], name: str) -> str | bool | None:
    """What vllm serve's argparse makes of `name` in `args`: the last `--name V`/`--name=V`, or
    True/False for a boolean `--name`/`--no-name`; None when absent."""
    found: str | bool | None = None
    bare = name.removeprefix("--")
    for i, word in enumerate(args):
        if word == name:
            found = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") \
                else True
        elif word.startswith(name + "="):
            found = word.split("=", 1)[1]
        elif word == f"--no-{bare}":
            found = False
    return found


def _retention_fits(env: dict[str, str], info: ValidationInfo) -> dict[str, str]:
    """The retention interval where vLLM 0.26.0 starts with it: a whole number of tokens, on a
    sliding-window or hybrid profile, a multiple of the block (--block-size where the profile gives
    one, else the default 16), and on a hybrid only with prefix caching on (off, vLLM's default for
    hybrids, the scheduler's block is the whole max_model_len)."""
    value = env.get(RETENTION)
    if value is None:
        return env
    if not value.isdigit():
        raise ValueError(f"{RETENTION} must be a whole number of tokens, a multiple of the KV "
                         f"block size {RETENTION_BLOCK} (vLLM refuses it otherwise), not {value!r}")
    attention = info.data.get("attention")
    args = [str(a) for a in info.data.get("args") or []]
    if attention == "full":
        raise ValueError(f"{RETENTION} on a full-attention profile (attention: full): vLLM 0.26.0 "
                         "refuses to start a model without sliding-window or Mamba layers with it")
    block = _flag(args, "--block-size")
    size = int(block) if isinstance(block, str) and block.isdigit() else RETENTION_BLOCK
    if int(value) % size:
        where = f"--block-size {size}" if block is not None else f"the KV block size {size}"
        raise ValueError(f"{RETENTION} must be a whole number of tokens, a multiple of {where} "
                         f"(vLLM refuses it otherwise), not {value!r}")
    if attention == "hybrid" and _flag(args, "--enable-prefix-caching") is not True:
        raise ValueError(f"{RETENTION} on a hybrid profile needs --enable-prefix-caching in its "
                         "args: vLLM 0.26.0 leaves it off for hybrids, and then the scheduler's "
                         "block is the whole max_model_len, a multiple of no such interval")
    return env


class Model(Strict):
    """A model identity (defaults.yml `models:`): one loopback port each."""

    checkpoint: Checkpoint
    port: Port
    max_model_len: Annotated[int, Field(ge=1, le=2**24)]  # tokens (16M: past any model's)
    # The checkpoint's attention layers: only `full` (every layer full attention), `sliding` (some
    # sliding-window layers) or `hybrid` (Mamba/linear-attention layers beside attention) decide
    # whether vLLM accepts the retention variable. Before `environment`: its check reads it.
    attention: Literal["full", "sliding", "hybrid"] = "full"
    args: list[ModelArg]                    # vllm serve flags; never host/port/alias/config
    environment: dict[UnitEnvName, Text]
    revision: Commit | None = None          # the checkpoint's commit; None: not pinned yet
    gated: bool = False                     # needs hf_token_file: never on a volunteer's box

    @field_validator("environment")
    @classmethod
    def _retention(cls, env: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        return _retention_fits(env, info)


class PluginPath(Strict):
    path: LocalPath                         # the plugin's directory on the operator's machine


class PluginGit(Strict):
    git_url: GitUrl
    ref: GitRef


class RateLimit(Strict):
    """caddy-ratelimit's zone for one public hostname: `events` per `window` per `key` (one of
    SERVER_KNOWN_KEYS: the client's address, never something the client sends)."""

    events: Annotated[int, Field(ge=1, le=1_000_000)]
    window: Duration
    key: Annotated[Placeholder, AfterValidator(server_known)]


class EdgeProxy(Strict):
    """How an edge spreads one hostname over its donors (defaults.yml `edge_proxy:`)."""

    lb_policy: Literal["round_robin", "least_conn", "random", "first"]
    lb_try_duration: DurationOrZero
    lb_try_interval: DurationOrZero
    health_uri: UriPath
    health_interval: Duration
    health_timeout: Duration


class CanarySettings(Strict):
    """defaults.yml `canary:`: the edge's canaries (files/edge_canary.py) and their verdict."""

    interval: Duration                      # between two rounds (each member asked once a round)
    timeout: Duration                       # one canary request, answer included
    fail_after: Annotated[int, Field(ge=1, le=100)]   # failed rounds in a row: out
    pass_after: Annotated[int, Field(ge=1, le=100)]   # passed rounds in a row: back in
    window: Annotated[int, Field(ge=1, le=1000)]      # rounds the pass rate is taken over
    min_agree: Annotated[float, Field(ge=0, le=1)]    # share of reference tokens that agree
    max_logprob_gap: Annotated[float, Field(ge=0, le=100)]  # mean |log-probability difference|
    max_logprob_gap_other_stack: Annotated[float, Field(ge=0, le=100)]  # the same, vs another stack
    references_dir: LocalPath               # `donors reference` writes, the deploy ships


class TunnelSettings(Strict):
    """defaults.yml `tunnel`: WireGuard between home donors (`reach: tunnel`) and their edges."""

    pool: TunnelPool                        # every tunnel address comes from here
    port: Port                              # UDP port a hub edge listens on
    keepalive: KeepaliveSeconds             # a donor's PersistentKeepalive (keeps NAT open)
    watch_interval: KeepaliveSeconds        # a donor pings its edges through the tunnel
    interface: WgInterface                  # the WireGuard interface (wg-quick@<it>)
    handshake_max_age: Annotated[int, Field(ge=30, le=3600)]  # verify: last handshake newer
    packages: list[DebPackage]              # on every box of a tunnel
    userspace_package: DebPackage           # where the kernel has no WireGuard module


class Settings(Strict):
    """defaults.yml less its catalogues (`cards:`, `models:`): the settings a box's typed host
    data carries as they are (donorkit/inventory/host_data.py's `DonorBox` extends this). Never
    validated alone: its validator is built with the first model that validates (`Defaults`), not at
    import (pydantic's `defer_build`; every run imports this)."""

    model_config = ConfigDict(defer_build=True)

    supported_distros: list[Distro]
    require_nvidia_smi: bool
    cuda_driver_minimums: dict[CudaVersion, DriverVersion]  # oldest driver each CUDA runs on
    apt_lock_wait: Annotated[int, Field(ge=0, le=86400)]  # seconds apt steps wait for locks
    cuda_repo_url: UrlTemplate
    cuda_keyring_deb: FileName
    cuda_keyring_path: AbsPath
    build_packages: list[DebPackage]
    service_user: Annotated[UserName, AfterValidator(not_root)]  # vLLM never runs as root
    install_root: Annotated[AbsPath, AfterValidator(valid_install_root)]
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
    engine_kernel_cache: LocalPath
    kernel_prebuild: bool                   # FlashInfer's kernels built before a first start
    kernel_prebuild_gib_per_job: Annotated[float, Field(gt=0, le=1024)]  # sizes MAX_JOBS
    kernel_prebuild_reserve_gib: Annotated[float, Field(ge=0, le=1024)]  # kept free meanwhile
    vllm_exl3_plugin: PluginPath | PluginGit
    vllm_exl3_plugin_dir: AbsPath           # under install_root (check_paths)
    vllm_exl3_plugin_dist: Annotated[str, matching(r"[A-Za-z0-9][A-Za-z0-9._-]*",
                                                    "a distribution name")]
    unit_environment: Annotated[dict[UnitEnvName, Text],
                                AfterValidator(_no_file_wide_retention)]
    unit_service: UnitService     # an allow-list: see UnitService
    caddy_source: Literal["distro", "upstream"]
    caddy_upstream_repo_url: Url
    caddy_upstream_key_url: Url
    caddy_https_port: CaddyTlsPort
    # caddy.service's own runtime directory (its drop-in creates it, and removes it on stop).
    caddy_admin_socket: Annotated[str, matching(r"/run/caddy/[a-z0-9][a-z0-9.-]*",
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
    edge_https_port: CaddyTlsPort
    edge_proxy: EdgeProxy
    acceptance: AcceptanceSettings           # `make accept`: workload, tolerance, results
    canary: CanarySettings                   # the edges' canaries (files/edge_canary.py)

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


class Defaults(Settings):
    """defaults.yml, and what a donor's merged overrides must still be: the settings and the
    catalogues a donor picks from (its card profile, the model identities it serves)."""

    cards: dict[Name, Card]
    models: dict[Name, Model]
    # Home donors behind NAT (donorkit/inventory/tunnel_plan.py): a box's typed data carries it as
    # `tunnel_settings` (its `tunnel` is what donorkit.inventory.tunnel_plan.plan makes of it).
    tunnel: TunnelSettings


class Donor(Strict):
    """One entry of donors.yml `donors:`."""

    # What pyinfra connects to; none for `reach: tunnel` (its tunnel address, through an edge).
    ssh_host: SshHost | None = None
    ssh_user: UserName                      # not root: sudo is used
    ssh_port: Port = 22
    ssh_key: LocalPath | None = None        # private key on the operator's machine
    ssh_known_hosts_file: LocalPath | None = None
    card: Name                              # a key of defaults.yml `cards:`
    routes: Annotated[dict[Hostname, Name], Field(min_length=1)]  # public hostname -> model
    overrides: dict[str, Any] = {}          # any defaults.yml key; validated after merging
    # direct: the edges and the operator reach ssh_host; tunnel: a home box behind NAT, it dials
    # the edges over WireGuard (donorkit/inventory/tunnel_plan.py) and is reached at its tunnel
    # address.
    reach: Literal["direct", "tunnel"] = "direct"
    tunnel_address: TunnelAddress | None = None   # None: derived from the name, in the pool
    tunnel_public_key: WgKey | None = None  # what `make join` printed on the box; None: not joined
    # Who controls the box (root on it): `operator` boxes may get the operator's secrets and build
    # the caches other boxes use; a `volunteer`'s box gets neither. None: operator for
    # reach: direct, volunteer for reach: tunnel (a home box is its owner's).
    owner: Literal["operator", "volunteer"] | None = None
    # Whether what this box builds (exllamav3's wheel, the engine's kernels) is copied back to
    # the operator's caches and shipped to the other boxes of its stack, where it runs as root
    # and in every engine: only a box the operator controls (refused on a volunteer's).
    cache_builder: bool = False


class Edge(Strict):
    """One entry of donors.yml `edges:`: a front door that proxies public hostnames to donors.

    Its own SSH settings, the public hostnames it serves (a list, or `all`: every hostname some
    donor routes), its Caddy source and its rate limit (`RateLimit`, or null: none). Its settings
    are defaults.yml merged with the file's and its own `overrides:` as for a donor; its upstreams
    are worked out from the donors' routes (donorkit.inventory.fleet), so adding or removing a
    donor changes the pools on the next run."""

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
    # As a tunnel's hub (it serves a tunnelled donor): where donors dial it (None: ssh_host),
    # its address in the pool (None: derived from the name), its key (its first deploy prints it).
    tunnel_endpoint: SshHost | None = None
    tunnel_address: TunnelAddress | None = None
    tunnel_public_key: WgKey | None = None


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
        if not isinstance(card, CudaCard):
            continue
        for field, cuda in (("cuda", card.cuda), ("vllm_variant", variant_cuda(card.vllm_variant))):
            if cuda and cuda not in defaults.cuda_driver_minimums:
                return f"cards.{name}.{field}", (f"CUDA {cuda} has no driver minimum (a version "
                                                 "like 580.65.06) under cuda_driver_minimums")
    return None


def resolved_owner(donor: Donor) -> str:
    """Who controls the box: its `owner`, else operator for reach: direct, volunteer for
    reach: tunnel."""
    return donor.owner or ("volunteer" if donor.reach == "tunnel" else "operator")


def check_box(defaults: Defaults, donor: Donor) -> tuple[str, str] | None:
    """Cross-checks of one box once merged: (field, problem), or None when it is sound."""
    if donor.reach == "direct" and donor.ssh_host is None:
        return "ssh_host", "missing (a donor reached directly needs it; a home box behind NAT: "\
            "reach: tunnel)"
    if donor.reach == "tunnel" and donor.ssh_host is not None:
        return "ssh_host", ("a tunnelled donor is reached at its tunnel address through an "
                            "edge: leave ssh_host out")
    if donor.reach == "direct":
        for field in ("tunnel_address", "tunnel_public_key"):
            if getattr(donor, field) is not None:
                return field, "only for a donor with reach: tunnel"
    if donor.cache_builder and resolved_owner(donor) == "volunteer":
        return "cache_builder", ("a volunteer's box (owner: volunteer, the default for reach: "
                                 "tunnel) builds no cache another box uses")
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
