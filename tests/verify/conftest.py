"""Post-deploy verification of donor boxes (pytest-testinfra), driven by the deploy's inventory.

Hosts come from the same data the deploy uses (donorkit.inventory.fleet.load_fleet), so every check
compares the box with what the inventory says it should be:

    pytest tests/verify                          # every donor: inventory/donors.yml or $DONORS_FILE
    pytest tests/verify --donors other.yml       # another donors file
    pytest tests/verify --limit hermes-4090      # names, groups, globs (pyinfra's --limit)
    pytest tests/verify --on-box h200-lent       # on the box itself, for donor NAME (no SSH)
    pytest tests/verify -n auto                  # hosts in parallel (pytest-xdist)
    pytest tests/verify --collect-only           # lists the checks; connects nowhere

Remote donors are reached with testinfra's paramiko backend as ssh_user@ssh_hostname:ssh_port,
with ssh_key if given, through sudo when ssh_user is not root, and checking host keys against
ssh_known_hosts_file when the host data names one, or --known-hosts PATH (the testbed writes
one per run), else ~/.ssh/known_hosts: an unknown or changed host key is refused, unless
--accept-unknown-host-keys (an unknown key is then accepted with a warning; a changed one
never). --on-box uses
testinfra's local backend (through sudo when not run as root: the checks read root-only state and
run commands as the service user).

Test ids are `donor`, `donor:model`, `donor:hostname` or `donor:model:Setting`, so the summary
names the failing host and check; edges (donors.yml `edges:`) are `edge` or
`edge:hostname:donor` (test_edge.py).
Skip or fail: a check SKIPS (saying why) when the box lacks what
it needs and the deploy could not have put it there (systemd not PID 1, a model whose /health is
not 200); on a box where systemd is PID 1 anything the deploy lays down that is missing FAILS.
"""

from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import paramiko
import pytest
from testinfra.backend.local import LocalBackend
from testinfra.backend.paramiko import ParamikoBackend
from testinfra.host import Host

from donorkit.commands import transport
from donorkit.inventory.fleet import FleetError, load_inventory
from donorkit.inventory.host_data import DonorBox, EdgeBox, ServedModel
from donorkit.inventory.limit import LimitError, select

CONNECT_TIMEOUT_S = 10


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("donors", "uncloseai donor verification")
    group.addoption("--donors", metavar="PATH",
                    help="donors file to verify (default: $DONORS_FILE or inventory/donors.yml)")
    group.addoption("--limit", action="append", default=[], metavar="NAME",
                    help="only these hosts: names, groups (donors, edges, a card profile) or "
                         "globs, as pyinfra's --limit (repeatable, or a comma list)")
    group.addoption("--on-box", metavar="NAME",
                    help="run on the box itself (testinfra local://) as donor NAME; no SSH")
    group.addoption("--known-hosts", metavar="PATH",
                    help="known_hosts file for every remote donor (default: each donor's "
                         "ssh_known_hosts_file, else ~/.ssh/known_hosts)")
    group.addoption("--accept-unknown-host-keys", action="store_true",
                    help="connect to a donor whose host key is not in the known_hosts file "
                         "(with a warning); without it an unknown key is refused")


def _option(config: pytest.Config, name: str, default: object = None) -> object:
    # The options exist only when this conftest was loaded at start-up (pytest tests/verify ...).
    try:
        return config.getoption(name)
    except ValueError:
        return default


def _select(config: pytest.Config) -> tuple[dict[str, DonorBox], dict[str, EdgeBox]]:
    """({donor: host data}, {edge: host data}) to verify, loaded once per process (no
    connection)."""
    cached = getattr(config, "_verify_selection", None)
    if cached is not None:
        return cached
    try:
        fleet, edges = load_inventory(_option(config, "donors"))
    except FleetError as exc:
        raise pytest.UsageError(f"inventory: {exc}") from None
    on_box = _option(config, "on_box")
    if on_box and on_box not in fleet:
        raise pytest.UsageError(f"--on-box {on_box}: no such donor; the inventory has "
                                f"{', '.join(sorted(fleet))}")
    try:
        donors, chosen_edges = select([on_box] if on_box else _option(config, "limit", []),
                                      fleet, edges)
    except LimitError as exc:
        raise pytest.UsageError(str(exc)) from None
    # Boxes the controller could not reach (pytest_configure below): one line each, no checks.
    gone = set(_unreachable(config))
    config._verify_selection = (  # type: ignore[attr-defined]
        {n: d for n, d in donors.items() if n not in gone},
        {n: d for n, d in chosen_edges.items() if n not in gone})
    return config._verify_selection  # type: ignore[attr-defined]


def selected_donors(config: pytest.Config) -> dict[str, DonorBox]:
    """{name: host data} of the donors to verify."""
    return _select(config)[0]


def selected_edges(config: pytest.Config) -> dict[str, EdgeBox]:
    """{name: host data} of the edges to verify."""
    return _select(config)[1]


def _unreachable(config: pytest.Config) -> dict[str, str]:
    """{host: why} of the boxes the controller could not reach: probed there once
    (pytest_configure), handed to xdist's workers in their workerinput."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        return worker.get("uncloseai_unreachable", {})
    return getattr(config, "_unreachable", {})


def _probe(config: pytest.Config) -> dict[str, str]:
    """Every selected box at once, `true` over SSH with the suite's own connection (bounded by
    CONNECT_TIMEOUT_S): {host: why} for those that do not answer."""
    if _option(config, "on_box") or config.option.collectonly:
        return {}
    donors, edges = _select(config)
    boxes = {**donors, **edges}
    if not boxes:
        return {}

    def why(data: DonorBox | EdgeBox) -> str | None:
        box = make_host(data, False, _option(config, "known_hosts"),
                        bool(_option(config, "accept_unknown_host_keys", False)))
        try:
            probe = box.run("true")
        except Exception as exc:  # noqa: BLE001 - every way of not reaching the box is one line
            return f"{type(exc).__name__}: {exc}".splitlines()[0]
        return None if probe.rc == 0 else f"`true` exited {probe.rc}: {probe.stderr.strip()}"

    # paramiko's transport thread logs each failed handshake with a traceback: the cause is
    # said once below, in the box's line.
    logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)
    with ThreadPoolExecutor(max_workers=min(16, len(boxes))) as pool:
        causes = dict(zip(boxes, pool.map(why, boxes.values()), strict=True))
    return {name: cause for name, cause in causes.items() if cause}


def pytest_configure(config: pytest.Config) -> None:
    # A bad inventory or an unknown --limit name is one usage error, before any collection.
    selected_donors(config)
    if getattr(config, "workerinput", None) is not None:
        return
    gone = _probe(config)
    if gone:
        config._unreachable = gone  # type: ignore[attr-defined]
        config._verify_selection = None  # type: ignore[attr-defined]
        selected_donors(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A check with no box left to run on (none selected of its kind, or all unreachable) is
    deselected, not reported as a skip per check."""
    empty = [item for item in items if any(
        str(mark.kwargs.get("reason", "")).startswith("got empty parameter set")
        for mark in item.iter_markers("skip"))]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]


def pytest_configure_node(node) -> None:
    """xdist (controller): each worker gets the unreachable boxes with its workerinput."""
    node.workerinput["uncloseai_unreachable"] = _unreachable(node.config)


def _unreachable_lines(config: pytest.Config) -> list[str]:
    fleet, edges = load_inventory(_option(config, "donors"))
    hosts = {**fleet, **edges}
    return [f"{name} ({hosts[name].ssh_user}@{hosts[name].ssh_hostname}:"
            f"{hosts[name].ssh_port}): {why}" for name, why in _unreachable(config).items()]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lines = _unreachable_lines(config) if _unreachable(config) else []
    for line in lines:
        terminalreporter.write_line(f"UNREACHABLE {line}", red=True, bold=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A box not reached is a failed verification, even when every check that ran passed (or
    none ran: every box unreachable)."""
    if _unreachable(session.config) and getattr(session.config, "workerinput", None) is None:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _axes(fixturenames: list[str]) -> tuple[str, ...]:
    """What a test is parametrised over, from the arguments it asks for."""
    if "route" in fixturenames:
        return ("donor", "route")
    if "setting" in fixturenames:
        return ("donor", "model", "setting")
    if "model" in fixturenames:
        return ("donor", "model")
    return ("donor",)


def _cases(data: DonorBox, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The parameter tuples one donor contributes for a test with these axes."""
    name = data.donor_name
    if "route" in axes:
        return [(name, r.hostname) for r in data.routes]
    if "setting" in axes:
        return [(name, m, key) for m in data.models for key in data.unit_service]
    if "model" in axes:
        return [(name, m) for m in data.models]
    return [(name,)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise per donor (and model/route/setting) with readable ids: donor:model; per edge
    (and hostname and donor) for the edge checks: edge:hostname:donor."""
    if "edge" in metafunc.fixturenames:
        edges = selected_edges(metafunc.config).values()
        if "upstream" in metafunc.fixturenames:
            cases = [(e.edge_name, s.hostname, u.donor) for e in edges
                     for s in e.sites for u in s.upstreams]
            metafunc.parametrize(("edge", "site", "upstream"), cases,
                                 ids=[":".join(c) for c in cases])
        else:
            names = [e.edge_name for e in edges]
            metafunc.parametrize("edge", names, ids=names)
        return
    if "donor" not in metafunc.fixturenames:
        return
    axes = _axes(metafunc.fixturenames)
    cases = [case for data in selected_donors(metafunc.config).values()
             for case in _cases(data, axes)]
    metafunc.parametrize(axes, cases, ids=[":".join(c) for c in cases])


class KnownHostsParamikoBackend(ParamikoBackend):
    """testinfra's paramiko backend, but honouring a known_hosts file (unknown keys refused)."""

    def __init__(self, hostspec: str, data: DonorBox | EdgeBox, known_hosts: str | None = None,
                 accept_unknown: bool = False, **kwargs: object) -> None:
        self.data = data  # a home donor's: its SSH goes through an edge
        self.known_hosts = known_hosts
        self.accept_unknown = accept_unknown
        super().__init__(hostspec, **kwargs)

    @functools.cached_property
    def client(self) -> paramiko.SSHClient:
        return transport.ssh_client(self.data, self.timeout, known_hosts=self.known_hosts,
                                    accept_unknown=self.accept_unknown)


def make_host(data: DonorBox | EdgeBox, on_box: bool, known_hosts: str | None = None,
              accept_unknown: bool = False) -> Host:
    """A testinfra Host for one donor; nothing connects until the first command."""
    if on_box:
        return Host(LocalBackend(sudo=os.geteuid() != 0))
    address = data.ssh_hostname
    address = f"[{address}]" if ":" in address else address
    backend = KnownHostsParamikoBackend(
        f"{data.ssh_user}@{address}:{data.ssh_port}",
        known_hosts=known_hosts or data.ssh_known_hosts_file,
        accept_unknown=accept_unknown, data=data,
        ssh_identity_file=data.ssh_key, timeout=CONNECT_TIMEOUT_S,
        sudo=data.sudo)
    return Host(backend)


_HOSTS: dict[str, Host | str] = {}


@pytest.fixture
def data(donor: str, request: pytest.FixtureRequest) -> DonorBox:
    """The donor's host data, exactly as the deploy sees it."""
    return selected_donors(request.config)[donor]


@pytest.fixture
def host(donor: str, data: DonorBox, request: pytest.FixtureRequest) -> Host:
    """The donor's box, connected once per process; an unreachable box errors every check once
    (the failure is remembered, so a dead host costs one timeout, not one per test)."""
    return connected(donor, data, request)


@pytest.fixture
def edge_data(edge: str, request: pytest.FixtureRequest) -> EdgeBox:
    """The edge's host data, exactly as the deploy sees it."""
    return selected_edges(request.config)[edge]


@pytest.fixture
def edge_host(edge: str, edge_data: EdgeBox, request: pytest.FixtureRequest) -> Host:
    """The edge's box, connected once per process (as `host` for a donor)."""
    return connected(edge, edge_data, request)


def connected(donor: str, data: DonorBox | EdgeBox, request: pytest.FixtureRequest) -> Host:
    """A box (donor or edge) by name, connected once per process."""
    if donor not in _HOSTS:
        box = make_host(data, bool(_option(request.config, "on_box")),
                        _option(request.config, "known_hosts"),
                        bool(_option(request.config, "accept_unknown_host_keys", False)))
        try:
            probe = box.run("true")
            _HOSTS[donor] = box if probe.rc == 0 else f"`true` exited {probe.rc}: {probe.stderr}"
        except Exception as exc:  # noqa: BLE001 - every way of not reaching the box is one error
            _HOSTS[donor] = f"{type(exc).__name__}: {exc}"
    box = _HOSTS[donor]
    if isinstance(box, str):
        where = f"{data.ssh_user}@{data.ssh_hostname}:{data.ssh_port}"
        pytest.fail(f"cannot run commands on {donor} ({where}): {box}", pytrace=False)
    return box


@pytest.fixture
def m(data: DonorBox, model: str) -> ServedModel:
    """The model profile of one unit on this donor."""
    return data.models[model]


@pytest.fixture
def route_model(data: DonorBox, route: str) -> ServedModel:
    """The model profile a public hostname routes to."""
    name = next(r.model for r in data.routes if r.hostname == route)
    return data.models[name]


# Checks of what only a CUDA engine has (toolkit, JIT, exllamav3, plugin, GPU, driver); a card
# profile with `engine: cpu` (vLLM's CPU build: the testbed's real-engine host) skips them.
CUDA_ONLY_MODULES = {"test_cuda.py", "test_plugin.py"}
CUDA_ONLY_TESTS = {"test_jit_compile_as_service_user", "test_torch_cuda_major_matches_nvcc",
                   "test_exllamav3_ext_built_for_card", "test_gpu_is_the_inventory_card",
                   "test_driver_is_new_enough_for_the_card_cuda",
                   "test_torch_sees_the_gpu_as_service_user",
                   "test_unit_leaves_the_gpu_devices_open"}


@pytest.fixture(autouse=True)
def _cuda_only(request: pytest.FixtureRequest) -> None:
    if "donor" not in request.fixturenames:
        return
    data = selected_donors(request.config)[request.getfixturevalue("donor")]
    name = request.node.originalname
    if data.card.engine == "cpu" and (request.path.name in CUDA_ONLY_MODULES
                                            or name in CUDA_ONLY_TESTS):
        pytest.skip(f"card profile '{data.card.name}' is vLLM's CPU engine: no CUDA, "
                    "exllamav3, plugin or GPU")
