"""A host's data as types: what the loader (donorkit.inventory.fleet) hands pyinfra for each donor
(`DonorBox`) and each edge (`EdgeBox`), every key a field; the deploy's tasks, the rendering, the
rollout, `make accept`, `make status` and the verification suite read the same models, never a
key no model names. A donor carries `schema.Settings`' fields plus what the loader derives once
(its card profile, served models and units, CUDA paths, the venv's install, its tunnel); an edge
the few settings its Caddy needs and one site per public hostname. Made with `model_construct`
from data already validated (validators built only when used: pydantic's `defer_build`);
tests/unit/test_fleet.py validates every box of the shipped and testbed inventories against them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Tag

from donorkit.inventory.card_profiles import CpuCard, CudaCard, engine_tag
from donorkit.inventory.schema import (
    CanarySettings,
    EdgeProxy,
    RateLimit,
    Settings,
    TunnelSettings,
)
from donorkit.inventory.values import Name, Strict

# vllm serve flags whose values change the numbers a model answers with (the canary's stack).
NUMERIC_FLAGS = ("--dtype", "--kv-cache-dtype", "--quantization")

DERIVED = ConfigDict(defer_build=True)


class CudaHostCard(CudaCard):
    """A GPU box's card profile, with the name it has in defaults.yml `cards:`."""

    model_config = DERIVED
    name: Name


class CpuHostCard(CpuCard):
    """vLLM's CPU engine's profile, with its name."""

    model_config = DERIVED
    name: Name


HostCard = Annotated[Annotated[CudaHostCard, Tag("engine=cuda")]
                     | Annotated[CpuHostCard, Tag("engine=cpu")], Discriminator(engine_tag)]


def host_card(name: str, card: CudaCard | CpuCard) -> CudaHostCard | CpuHostCard:
    """The profile `card` of defaults.yml `cards:` (validated there), named."""
    typed = CudaHostCard if isinstance(card, CudaCard) else CpuHostCard
    return typed.model_construct(**dict(card), name=name)


class ServedModel(Strict):
    """A model identity this donor serves (defaults.yml `models:`, merged), with its unit."""

    model_config = DERIVED
    name: Name                          # the identity: `qwen`
    unit: str                           # its systemd unit: `vllm-qwen.service`
    checkpoint: str
    port: int
    max_model_len: int
    args: list[str]                     # vllm serve flags, as words
    environment: dict[str, str]
    revision: str | None                # the checkpoint's commit; None: not pinned (yet)
    gated: bool = False                 # fetched with the operator's token (operator boxes only)

    @property
    def pinned(self) -> bool:
        """A local-path checkpoint (`/srv/...`) has no revision to pin."""
        return bool(self.revision) or self.checkpoint.startswith("/")


class Route(Strict):
    """A public hostname routed to this donor, and the model identity it reaches."""

    model_config = DERIVED
    hostname: str
    model: Name


class Upstream(Strict):
    """One donor behind an edge's site: its name, and `address:port` of its Caddy."""

    model_config = DERIVED
    donor: Name
    address: str
    # What the edge's canary compares it with (files/edge_canary.py): the revision it serves
    # under this site's model and its stack (DonorBox.canary_stack).
    revision: str | None = None
    stack: str | None = None


class Site(Strict):
    """One public hostname on an edge: the model and checkpoint behind it, its donors, and the
    rate limit's zone name (the hostname as one word)."""

    model_config = DERIVED
    hostname: str
    model: Name
    checkpoint: str
    upstreams: list[Upstream]
    zone: str


class TunnelPeer(Strict):
    """One peer of a box's tunnel: on an edge a donor, on a donor an edge (with the endpoint
    the donor dials)."""

    model_config = DERIVED
    name: Name
    public_key: str | None              # None: not joined yet (an edge: no peer then)
    address: str                        # its tunnel address
    endpoint: str | None = None         # a donor's peer: the edge's host:port; an edge's: None


class DonorTunnel(Strict):
    """A home donor's tunnel (donorkit.inventory.tunnel_plan.plan): what its WireGuard config,
    firewall and watch are made of, and what its join file carries."""

    model_config = DERIVED
    role: Literal["donor"] = "donor"
    entry: str                          # "donor 'x'": where the operator pastes its key
    interface: str
    address: str
    keepalive: int
    watch_interval: int
    public_key: str | None              # the inventory's; None: not joined (or joining)
    peers: list[TunnelPeer]             # the edges it dials that have their key
    allowed_ports: list[int]            # its Caddy's and sshd's ports, for the edges only
    packages: list[str]
    userspace_package: str
    handshake_max_age: int


class EdgeTunnel(Strict):
    """A hub edge's tunnel (donorkit.inventory.tunnel_plan.plan): the pool routed to it, one peer
    per joined home donor among its upstreams."""

    model_config = DERIVED
    role: Literal["edge"] = "edge"
    entry: str
    interface: str
    address: str
    prefixlen: int
    listen_port: int
    public_key: str | None
    peers: list[TunnelPeer]
    waiting: list[Name]                 # its home donors with no key yet: no peer
    packages: list[str]
    userspace_package: str
    handshake_max_age: int


class SshJump(Strict):
    """The edge a home donor's SSH goes through: that edge's own SSH data."""

    model_config = DERIVED
    ssh_hostname: str
    ssh_port: int
    ssh_user: str
    ssh_key: str | None = None
    ssh_known_hosts_file: str | None = None


class _Login(Strict):
    """How pyinfra reaches the box: these fields are pyinfra's own host data keys."""

    model_config = DERIVED
    ssh_hostname: str
    ssh_user: str
    ssh_port: int
    ssh_key: str | None = None          # absolute, on the operator's machine
    ssh_known_hosts_file: str | None = None

    @property
    def sudo(self) -> bool:
        """A login user other than root works through sudo (pyinfra's `_sudo`)."""
        return self.ssh_user != "root"

    def pyinfra_data(self) -> dict[str, Any]:
        """pyinfra's host data: every field, its value as it is (typed), and `_sudo`."""
        data = {field: getattr(self, field) for field in type(self).model_fields}
        for field in ("ssh_key", "ssh_known_hosts_file"):
            if data[field] is None:  # pyinfra's own default, as if the key were not there
                del data[field]
        if self.sudo:
            data["_sudo"] = True
        return data

    @classmethod
    def from_pyinfra(cls, data: Any) -> Any:
        """The model back from pyinfra's host data (`host.data`): its fields, not validated
        again (pyinfra_data made them from a validated model)."""
        return cls.model_construct(**{field: data.get(field) for field in cls.model_fields})


class DonorBox(_Login, Settings):
    """A donor's host data: its merged settings (schema.Settings) and what is derived from them."""

    role: Literal["donor"] = "donor"
    donor_name: Name
    card: HostCard
    cuda_version: str | None            # the card's toolkit; None: a cpu engine
    cuda_home: str | None               # /usr/local/cuda-<cuda_version>
    cuda_package: str | None            # cuda-toolkit-13-3
    driver_minimum: str | None          # the oldest driver the box may have
    driver_minimum_cuda: str | None     # the CUDA version that sets it
    service_home: str
    vllm_executable: str                # `{venv_dir}` filled in
    # [Service] settings as defaults.yml orders them, `{service_home}` filled in
    unit_service: dict[str, str | int | bool]
    routes: list[Route]
    models: dict[Name, ServedModel]     # the identities this box serves
    retired_units: list[str]            # units of the identities it does not: removed
    venv_requirements: list[str]        # what the venv step checks
    venv_install_specs: list[str]       # what uv installs when a check fails
    venv_index_args: list[str]
    vllm_installed_version: str         # what `vllm --version` reports
    trusted_clients: list[str]          # client certificates its Caddy accepts (edges, operator)
    # How it is reached (donorkit/inventory/tunnel_plan.py): `direct` at ssh_host; `tunnel`, a home
    # box behind NAT, at its tunnel address (ssh_hostname) through an edge: the rest is
    # tunnel_plan.plan's.
    reach: Literal["direct", "tunnel"] = "direct"
    # Who is root on it (schema.Donor.owner, resolved): a volunteer's box gets no operator secret
    # and builds no cache another box uses.
    owner: Literal["operator", "volunteer"] = "operator"
    # schema.Donor.cache_builder; and the names of every cache builder of the inventory: only
    # their cache entries go to other boxes (donorkit/box/wheel_cache.py).
    cache_builder: bool = False
    cache_builders: list[Name] = []
    tunnel_settings: TunnelSettings     # defaults.yml `tunnel`, merged
    tunnel_address: str | None = None   # a tunnelled donor's (its entry's, or derived)
    tunnel_public_key: str | None = None  # pasted by the operator; None: not joined
    tunnel: DonorTunnel | None = None   # None: not a tunnelled donor
    tunnel_hubs: list[Name] = []        # the edges it dials (those serving its hostnames)
    ssh_proxy_command: list[str] | None = None    # `ssh -W` to its sshd through the edge
    caddy_proxy_command: list[str] | None = None  # ... and to its Caddy (status, rollout)
    ssh_jump: Name | None = None        # that edge's name
    ssh_jump_data: SshJump | None = None  # that edge's SSH data (for its ssh_config)

    @property
    def name(self) -> str:
        return self.donor_name

    @property
    def cuda_engine(self) -> bool:
        return self.card.engine == "cuda"

    def canary_stack(self, model: str) -> str:
        """The stack a canary reference of `model` is recorded on and compared within (`donors
        reference`): the card profile, its CUDA toolkit (or `cpu`), the vLLM release, and the
        engine flags that change the numbers (docs/benchmarks.md: an fp8 KV cache is 15 times the
        honest spread of one stack away from a float16 one), from the inventory alone."""
        args = [*self.models[model].args, *map(str, self.card.vllm_args)]
        numerics = []
        for flag in NUMERIC_FLAGS:
            for i, word in enumerate(args):
                if word == flag and i + 1 < len(args):
                    numerics.append(args[i + 1])
                elif word.startswith(flag + "="):
                    numerics.append(word.split("=", 1)[1])
        engine = "cuda" + self.cuda_version if self.cuda_version else "cpu"
        return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(
            [self.card.name, engine, f"vllm{self.vllm_version}", *numerics]))

    @property
    def exllamav3_stamp(self) -> str:
        """The exllamav3 stack installed in the venv (tasks/exllamav3.py writes it; a change
        restarts the units, tasks/units.py)."""
        return f"{self.install_root}/state/exllamav3.stack"


class EdgeBox(_Login):
    """An edge's host data: the settings its Caddy needs and one site per public hostname."""

    role: Literal["edge"] = "edge"
    edge_name: Name
    install_root: str
    apt_lock_wait: int
    caddy_source: Literal["distro", "upstream"]
    caddy_upstream_repo_url: str
    caddy_upstream_key_url: str
    caddy_admin_socket: str
    caddy_dial_timeout: str
    caddy_response_header_timeout: str
    caddy_log_scrubbed_headers: list[str]
    caddy_access_log: str
    caddy_tls_dir: str
    pki_dir: str
    pki_renew_days: int
    edge_https_port: int
    edge_proxy: EdgeProxy
    canary: CanarySettings
    public_tls: Literal["acme", "private_ca"]
    rate_limit: RateLimit | None
    sites: list[Site]
    # As the hub of home donors (donorkit/inventory/tunnel_plan.py): where they dial it, its tunnel
    # address (its entry's or derived; set when it is a hub), its key; `tunnel`: None when no
    # tunnelled donor is among its upstreams.
    tunnel_settings: TunnelSettings
    tunnel_endpoint: str
    tunnel_address: str | None = None
    tunnel_public_key: str | None = None
    tunnel: EdgeTunnel | None = None

    @property
    def name(self) -> str:
        return self.edge_name


Box = Annotated[DonorBox | EdgeBox, Discriminator("role")]


def this_box(host: Any) -> DonorBox | EdgeBox:
    """The typed data of a pyinfra host (in a task: `this_box(host)`), by its role."""
    kind = EdgeBox if host.data.get("role") == "edge" else DonorBox
    return kind.from_pyinfra(host.data)
