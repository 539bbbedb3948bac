"""The testbed on a fresh machine: with none of its tools installed, tearing down what cannot exist
yet is a no-op (never an error) and the tool check names every missing package. Run here with
the tools out of reach: the lookup pointed at an empty directory and PATH emptied, and every
place the teardown reads or deletes moved to an empty temporary directory (never this machine's
real testbed, which another run may be using)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from donorkit.commands.transport import wait_until
from tests.support import common, containers, hosts, network, www


@pytest.fixture
def no_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setattr(common, "TOOL_DIRS", [str(empty)], raising=False)
    monkeypatch.setenv("PATH", str(empty))
    work = tmp_path / "testbed"
    monkeypatch.setattr(hosts, "STATE", work / "state.json")
    monkeypatch.setattr(hosts, "KNOWN_HOSTS", work / "known_hosts")
    monkeypatch.setattr(hosts, "SSH_KEY", work / "ssh/id_ed25519")
    monkeypatch.setattr(containers, "HOSTS_DIR", work / "hosts")
    monkeypatch.setattr(network, "IP_FORWARD_SAVED", work / "ip_forward.orig")
    # The teardown stops any HTTP server serving www.WWW: this worktree's running testbed's
    # (seen: `make test` beside a testbed run of the same worktree killed its server).
    monkeypatch.setattr(www, "WWW", work / "www")
    return work


def test_teardown_without_any_tool_is_a_no_op(no_tools: Path) -> None:
    hosts.down()  # today's `hosts.up` ran this before installing nft: "No such file: 'nft'"
    network.teardown()
    assert network.our_netns() == [] and network.our_links() == []


def test_tool_check_names_every_missing_package(no_tools: Path) -> None:
    assert common.missing_packages(hosts.TOOLS) == list(hosts.TOOLS)
    assert common.missing_packages({"caddy": "caddy"}) == ["caddy"]


def test_tool_check_finds_a_tool_in_its_directories(no_tools: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    found = tmp_path / "sbin"
    found.mkdir()
    (found / "nft").write_text("#!/bin/sh\n")
    (found / "nft").chmod(0o755)
    monkeypatch.setattr(common, "TOOL_DIRS", [str(found)])
    assert "nftables" not in common.missing_packages(hosts.TOOLS)
    assert "debootstrap" in common.missing_packages(hosts.TOOLS)


def test_a_started_host_is_alive_until_the_kernel_says_it_exited() -> None:
    """The testbed's start check asks waitpid, not /proc/PID/cmdline (empty for a moment right
    after Popen returns: a running nspawn looked gone and was started twice)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert containers.exited(child.pid, "tb-x") is None  # at once: running, whatever cmdline
        child.kill()
        found: list[str | None] = []

        def reaped() -> str | None:
            found.append(containers.exited(child.pid, "tb-x"))
            return None if found[-1] is not None else "still running"

        wait_until(reaped, 10, 0.01)
        assert found[-1] == "killed by signal 9", found[-3:]
    finally:
        child.kill()
