"""Load and validate the fleet (donors.yml + defaults.yml) into per-host pyinfra data.

What each key may hold is donorkit/inventory/schema.py. Every user mistake becomes one FleetError
naming the file, the entry and the field, raised before any connection is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from donorkit.inventory import box_ports, pki, schema, tunnel_plan, values
from donorkit.inventory.host_data import (
    CudaHostCard,
    DonorBox,
    EdgeBox,
    Route,
    ServedModel,
    Site,
    Upstream,
    host_card,
)
from donorkit.inventory.host_software import RequirementsFileError, driver_minimum, venv_install
from donorkit.inventory.inventory_files import (
    FleetError,
    check_strings,
    label,
    read_yaml,
    short,
    validate,
)
from donorkit.inventory.paths import REPO_ROOT, donors_file, operator_path
from donorkit.inventory.pki import OPERATOR_CLIENT
from donorkit.inventory.schema import PluginPath

__all__ = ["DEFAULTS_FILE", "DONORS_FILE", "FleetError", "check_revisions", "load_fleet",
           "load_inventory", "plugin_local_path", "read_yaml", "token_file_problem"]

DEFAULTS_FILE = REPO_ROOT / "inventory" / "defaults.yml"
DONORS_FILE = REPO_ROOT / "inventory" / "donors.yml"


def plugin_local_path(source: PluginPath) -> Path:
    """The plugin's directory on the operator's machine (relative paths: from the fleet
    directory, or the repo root without one)."""
    return operator_path(source.path)


# What gives a private key away, in the first bytes of a file (PEM, OpenSSH, PuTTY).
_PRIVATE_KEY_MARKS = ("PRIVATE KEY-----", "PuTTY-User-Key-File", "OPENSSH PRIVATE KEY")


def token_file_problem(value: str | None) -> str | None:
    """hf_token_file is uploaded to every donor: never a file under an .ssh directory, never a
    file that holds a private key (a file not there yet is the weights step's to report)."""
    if not value:
        return None
    resolved = operator_path(value)
    if ".ssh" in Path(value).parts or ".ssh" in resolved.parts:
        return (f"{value} is under an .ssh directory: SSH keys are never uploaded (the token "
                "file goes to every donor)")
    try:
        with resolved.open("rb") as handle:
            head = handle.read(65536).decode("utf-8", "replace")
    except OSError:
        return None
    if any(mark in head for mark in _PRIVATE_KEY_MARKS):
        return f"{value} holds a private key, not a Hugging Face token"
    return None


def _merged(defaults: dict, override: Any, where: str, origin: str
            ) -> tuple[dict, schema.Defaults]:
    """defaults deep-merged with one `overrides:` mapping, and the result validated as
    defaults.yml (once: the host's settings are that model's values)."""
    if not isinstance(override, dict):
        raise FleetError(f"{where}: field '{origin}': must be a mapping, "
                         f"got {type(override).__name__} {short(override)}")
    for key in override:
        if key not in schema.Defaults.model_fields:
            raise FleetError(f"{where}: field '{origin}.{label(key)}': not a key of defaults.yml")
    merged = schema.deep_merge(defaults, override)
    # defaults.yml was valid alone: whatever is wrong now came with this override.
    return merged, validate(schema.Defaults, merged, where, f"{origin}.")


def _ssh_data(entry: schema.Donor | schema.Edge, hostname: str | None = None
              ) -> dict[str, Any]:
    """pyinfra's SSH keys; relative key paths are the operator's (paths.operator_path), like
    pki_dir. `hostname`: a tunnelled donor's tunnel address (it has no ssh_host)."""
    return {"ssh_hostname": hostname or entry.ssh_host, "ssh_user": entry.ssh_user,
            "ssh_port": entry.ssh_port,
            "ssh_key": None if entry.ssh_key is None else str(operator_path(entry.ssh_key)),
            "ssh_known_hosts_file": (None if entry.ssh_known_hosts_file is None
                                     else str(operator_path(entry.ssh_known_hosts_file)))}


def _donor_box(name: str, donor: schema.Donor, merged: dict, settings: schema.Defaults,
               trusted_clients: list[str], where: str) -> DonorBox:
    """Everything the tasks and templates need for one donor, derived once, here."""
    problem = schema.check_box(settings, donor)
    if problem:
        raise FleetError(f"{where}: field '{problem[0]}': {problem[1]}")
    card = host_card(donor.card, settings.cards[donor.card])
    served = sorted(set(donor.routes.values()))
    cuda = card.cuda if isinstance(card, CudaHostCard) else None
    service_home = f"/home/{settings.service_user}"
    try:
        install = venv_install(card, settings)
    except RequirementsFileError as exc:
        raise FleetError(f"{where}: field 'cards.{card.name}.requirements_file': {exc}") from None
    # A tunnelled donor is reached at its tunnel address (donorkit/inventory/tunnel_plan.py plans
    # the rest), which is also its identity among the boxes.
    tunnel_host = None if donor.reach != "tunnel" else (
        donor.tunnel_address or tunnel_plan.derived_address(settings.tunnel.pool, name))
    # A volunteer's box (its owner is root on it) gets no operator secret: no Hugging Face
    # token, so no gated checkpoint either (README "A home donor behind NAT").
    owner = donor.owner or ("volunteer" if donor.reach == "tunnel" else "operator")
    if owner == "volunteer":
        gated = next((h for h, m in sorted(donor.routes.items()) if settings.models[m].gated), None)
        if gated:
            model = donor.routes[gated]
            raise FleetError(f"{where}: field 'routes.{gated}': model '{model}' is gated "
                             f"(models.{model}.gated) and this box is a volunteer's (owner: "
                             "volunteer): it gets no Hugging Face token; route an ungated "
                             "model here, or set owner: operator if the operator controls it")
    return DonorBox.model_construct(
        **{field: getattr(settings, field) for field in schema.Settings.model_fields
           if field not in ("vllm_executable", "unit_service", "hf_token_file")},
        hf_token_file=None if owner == "volunteer" else settings.hf_token_file,
        **_ssh_data(donor, tunnel_host),
        donor_name=name,
        card=card,
        cuda_version=cuda,
        **driver_minimum(settings.cuda_driver_minimums, cuda,
                         card.vllm_variant if isinstance(card, CudaHostCard) else None),
        cuda_home=f"/usr/local/cuda-{cuda}" if cuda else None,
        cuda_package=f"cuda-toolkit-{cuda.replace('.', '-')}" if cuda else None,
        service_home=service_home,
        vllm_executable=settings.vllm_executable.replace("{venv_dir}", settings.venv_dir),
        # [Service] values may name the service user's home (ReadWritePaths=, BindPaths=); in
        # defaults.yml's order (the unit's text, so its digest, follows it).
        unit_service={k: v.replace("{service_home}", service_home) if isinstance(v, str) else v
                      for k, v in merged["unit_service"].items()},
        routes=[Route.model_construct(hostname=h, model=m)
                for h, m in sorted(donor.routes.items())],
        models={m: ServedModel.model_construct(
            name=m, unit=f"vllm-{m}.service",
            **{**dict(settings.models[m]), "args": [str(a) for a in settings.models[m].args]})
            for m in served},
        # Units of the identities this box does not serve: removed, so a switch frees the GPU.
        retired_units=[f"vllm-{m}.service" for m in sorted(settings.models) if m not in served],
        **install,
        trusted_clients=trusted_clients,
        reach=donor.reach,
        owner=owner,
        tunnel_settings=settings.tunnel,
        tunnel_address=donor.tunnel_address,
        tunnel_public_key=donor.tunnel_public_key,
        cache_builder=donor.cache_builder,
    )


def load_fleet(donors_path: Path | str | None = None, defaults_path: Path | str | None = None,
               require_local_sources: bool = False) -> dict[str, DonorBox]:
    """Return {donor name: host data}; raise FleetError on any mistake in either file."""
    return load_inventory(donors_path, defaults_path, require_local_sources)[0]


class _Pool:
    """The donors routing one public hostname, and the checkpoint they all serve there."""

    def __init__(self, model: str, checkpoint: str, first: str) -> None:
        self.model, self.checkpoint, self.donors = model, checkpoint, [first]


def _pools(donors: dict[str, DonorBox], donors_path: Path) -> dict[str, _Pool]:
    """{public hostname: its pool} from every donor's routes. One hostname is one model: every
    donor routing it must serve the same checkpoint (the edge's health check and the users'
    `model` field name it)."""
    pools: dict[str, _Pool] = {}
    for name, box in donors.items():
        for route in box.routes:
            checkpoint = box.models[route.model].checkpoint
            pool = pools.get(route.hostname)
            if pool is None:
                pools[route.hostname] = _Pool(route.model, checkpoint, name)
                continue
            if checkpoint != pool.checkpoint:
                raise FleetError(
                    f"{donors_path}: donor '{name}': field 'routes.{route.hostname}': serves "
                    f"{checkpoint}, but donor '{pool.donors[0]}' serves "
                    f"{pool.checkpoint} under that hostname (one hostname, one checkpoint)")
            pool.donors.append(name)
    return pools


def _edge_box(name: str, edge: schema.Edge, settings: schema.Defaults,
              donors: dict[str, DonorBox], pools: dict[str, _Pool], where: str) -> EdgeBox:
    """An edge's host data: its settings and one site per public hostname with its donors."""
    if edge.hostnames == "all":
        hostnames = sorted(pools)
    else:
        hostnames = sorted(set(edge.hostnames))
        for hostname in hostnames:
            if hostname not in pools:
                raise FleetError(f"{where}: field 'hostnames': no donor routes {hostname} "
                                 f"(routed: {', '.join(sorted(pools))})")
    sites = []
    for hostname in hostnames:
        pool = pools[hostname]
        upstreams = []
        for donor in pool.donors:
            address = donors[donor].ssh_hostname
            address = f"[{address}]" if ":" in address else address
            upstreams.append(Upstream.model_construct(
                donor=donor, address=f"{address}:{donors[donor].caddy_https_port}",
                revision=donors[donor].models[pool.model].revision,
                stack=donors[donor].canary_stack(pool.model)))
        sites.append(Site.model_construct(
            hostname=hostname, model=pool.model, checkpoint=pool.checkpoint, upstreams=upstreams,
            zone=hostname.replace(".", "_").replace("-", "_")))
    kept = {field: getattr(settings, field) for field in EdgeBox.model_fields
            if field in schema.Settings.model_fields and field != "caddy_source"}
    return EdgeBox.model_construct(
        **kept,
        **_ssh_data(edge),
        edge_name=name,
        caddy_source=edge.caddy_source or settings.caddy_source,
        public_tls=edge.public_tls or settings.edge_public_tls,
        rate_limit=(edge.rate_limit if "rate_limit" in edge.model_fields_set
                    else settings.edge_rate_limit),
        sites=sites,
        tunnel_settings=settings.tunnel,
        tunnel_endpoint=edge.tunnel_endpoint or edge.ssh_host,
        tunnel_address=edge.tunnel_address,
        tunnel_public_key=edge.tunnel_public_key,
    )


def _refuse(where: str, problem: tuple[str, str] | None) -> None:
    if problem:
        raise FleetError(f"{where}: field '{problem[0]}': {problem[1]}")


def _one_box_per_address(seen: dict[str, str], box: DonorBox | EdgeBox, what: str,
                         where: str) -> None:
    """One box, one entry: values.box_identity's spelling, whatever the SSH port. A tunnelled
    donor's tunnel address is checked against the other tunnel addresses (tunnel_plan.plan)."""
    if getattr(box, "reach", "direct") != "direct":
        return          # its tunnel address: tunnel_plan.plan checks it against every box's
    address = values.box_identity(box.ssh_hostname)
    if address in seen:
        raise FleetError(f"{where}: field 'ssh_host': {box.ssh_hostname} is the box of "
                         f"{seen[address]} (one box, one entry)")
    seen[address] = what


def load_inventory(donors_path: Path | str | None = None,
                   defaults_path: Path | str | None = None,
                   require_local_sources: bool = False
                   ) -> tuple[dict[str, DonorBox], dict[str, EdgeBox]]:
    """Return ({donor name: host data}, {edge name: host data}); raise FleetError on any
    mistake in either file."""
    donors_path = Path(donors_path or donors_file())
    defaults_path = Path(defaults_path or DEFAULTS_FILE)
    defaults = read_yaml(defaults_path)
    if not isinstance(defaults, dict):
        raise FleetError(f"{defaults_path}: must be a mapping of settings, "
                         f"got {type(defaults).__name__}")
    check_strings(defaults, defaults_path)
    settings = validate(schema.Defaults, defaults, str(defaults_path),
                        known=schema.Defaults.model_fields)
    problem = schema.check_driver_minimums(settings, list(settings.cards))
    if problem:
        raise FleetError(f"{defaults_path}: field '{problem[0]}': {problem[1]}")
    doc = read_yaml(donors_path)
    if not isinstance(doc, dict) or not isinstance(doc.get("donors"), dict) or not doc["donors"]:
        raise FleetError(f"{donors_path}: must be a mapping with a non-empty 'donors' mapping")
    check_strings(doc, donors_path)
    inventory = validate(schema.Inventory, doc, str(donors_path),
                         known=schema.Inventory.model_fields)
    file_wide, _ = _merged(defaults, inventory.overrides, str(donors_path), "overrides")
    problem = token_file_problem(file_wide["hf_token_file"])
    if problem:
        origin = ((str(donors_path), "overrides.") if "hf_token_file" in inventory.overrides
                  else (str(defaults_path), ""))
        raise FleetError(f"{origin[0]}: field '{origin[1]}hf_token_file': {problem}")
    # Each donor's Caddy accepts exactly these client certificates: an edge deleted here loses
    # access at the donors' next deploy (donorkit/inventory/pki.py).
    trusted_clients = [*sorted(inventory.edges), OPERATOR_CLIENT]
    fleet: dict[str, DonorBox] = {}
    seen_addresses: dict[str, str] = {}
    for name, entry in inventory.donors.items():
        where = f"{donors_path}: donor '{label(name)}'"
        if not isinstance(entry, dict):
            raise FleetError(f"{where}: must be a mapping, got {type(entry).__name__}")
        donor = validate(schema.Donor, entry, where, known=schema.Donor.model_fields)
        merged, settings = _merged(file_wide, donor.overrides, where, "overrides")
        problem = token_file_problem(donor.overrides.get("hf_token_file"))
        if problem:
            raise FleetError(f"{where}: field 'overrides.hf_token_file': {problem}")
        box = _donor_box(name, donor, merged, settings, trusted_clients, where)
        _refuse(where, box_ports.donor_port_problem(box))
        _one_box_per_address(seen_addresses, box, f"donor '{name}'", where)
        fleet[name] = box
    # Every box knows the inventory's cache builders: their entries alone go to other boxes.
    builders = sorted(name for name, box in fleet.items() if box.cache_builder)
    fleet = {name: box.model_copy(update={"cache_builders": builders})
             for name, box in fleet.items()}
    pools = _pools(fleet, donors_path)
    edges: dict[str, EdgeBox] = {}
    for name, entry in inventory.edges.items():
        where = f"{donors_path}: edge '{label(name)}'"
        if not isinstance(entry, dict):
            raise FleetError(f"{where}: must be a mapping, got {type(entry).__name__}")
        if name in fleet:
            raise FleetError(f"{where}: a donor has that name too (host names are unique)")
        if pki.is_operator_client(name):
            raise FleetError(f"{where}: name: the operator's own client certificates are named "
                             f"so ({', '.join(pki.OPERATOR_CLIENT_NAMES)}, operator-*): an edge "
                             "of that name would share the operator's pair")
        edge = validate(schema.Edge, entry, where, known=schema.Edge.model_fields)
        _, settings = _merged(file_wide, edge.overrides, where, "overrides")
        box = _edge_box(name, edge, settings, fleet, pools, where)
        _refuse(where, box_ports.edge_port_problem(box))
        _one_box_per_address(seen_addresses, box, f"edge '{name}'", where)
        edges[name] = box
    entries = {**{n: f"{donors_path}: donor '{label(n)}'" for n in fleet},
               **{n: f"{donors_path}: edge '{label(n)}'" for n in edges}}
    try:
        tunnel_plan.check_keys(fleet, edges, entries)
        tunnel_plan.plan(fleet, edges, entries)
        tunnel_plan.check_tunnel_ports(fleet, edges, inventory.donors, entries)
    except tunnel_plan.TunnelError as exc:
        raise FleetError(str(exc)) from None
    if require_local_sources:
        for name, box in fleet.items():
            source = box.vllm_exl3_plugin
            # A cpu engine installs no plugin (deploy.py): its source is not needed.
            if box.cuda_engine and isinstance(source, PluginPath) \
                    and not plugin_local_path(source).is_dir():
                own = inventory.donors[name].get("overrides") or {}
                where = (f"{donors_path}: donor '{name}': field 'overrides.vllm_exl3_plugin'"
                         if "vllm_exl3_plugin" in own else
                         f"{donors_path}: field 'overrides.vllm_exl3_plugin'"
                         if "vllm_exl3_plugin" in inventory.overrides else
                         f"{defaults_path}: field 'vllm_exl3_plugin' (donor '{name}')")
                raise FleetError(f"{where}: local path {plugin_local_path(source)} does not "
                                 "exist on this machine: the vllm-exl3 plugin's checkout (README "
                                 "\"Prerequisites\"), or set {git_url, ref} instead")
    return fleet, edges


def check_revisions(fleet: dict[str, DonorBox], donors_path: Path | str | None = None) -> None:
    """Every model a donor serves has its checkpoint's commit pinned (`models.<m>.revision`), or
    one FleetError naming the donors file, the donor and the field: refused before any
    connection, not at the weights step after CUDA, vLLM and exllamav3 were installed. A
    checkpoint that is a path on the box has no revision."""
    where = donors_path or donors_file()
    for name, box in fleet.items():
        for model in box.models.values():
            if model.pinned:
                continue
            raise FleetError(f"{where}: donor '{name}': field 'models.{model.name}.revision': "
                             f"not pinned: `donors pin` resolves {model.checkpoint} at its "
                             "branch (main) to its commit and writes it in")
