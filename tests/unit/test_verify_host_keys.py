"""The verification suite's SSH connections refuse an unknown host key unless told otherwise: a
real paramiko SSH server on loopback (pyinfra_declared's SSH socket test server)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import paramiko
import pytest

from donorkit.inventory.host_data import EdgeBox
from pyinfra_declared.tests.test_ssh_socket import _key_file, ssh_server  # noqa: F401 (fixture)


def test_verify_suite_refuses_an_unknown_host_key(ssh_server: int,  # noqa: F811
                                                  tmp_path: Path) -> None:
    """tests/verify connects only to hosts whose key is known, unless told otherwise."""
    spec_ = importlib.util.spec_from_file_location(
        "verify_conftest", Path(__file__).resolve().parents[1] / "verify/conftest.py")
    verify_conftest = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(verify_conftest)
    KnownHostsParamikoBackend = verify_conftest.KnownHostsParamikoBackend  # noqa: N806

    known = tmp_path / "known_hosts"
    known.write_text("")
    key = str(_key_file(tmp_path, "client"))
    spec = f"root@127.0.0.1:{ssh_server}"
    # Only the login fields: what the backend's connection reads of a host's data.
    data = EdgeBox.model_construct(ssh_hostname="127.0.0.1", ssh_port=ssh_server,
                                   ssh_user="root", ssh_key=key)
    refusing = KnownHostsParamikoBackend(spec, data, known_hosts=str(known),
                                         ssh_identity_file=key)
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        refusing.client  # noqa: B018 - connecting is the point
    accepting = KnownHostsParamikoBackend(spec, data, known_hosts=str(known), accept_unknown=True,
                                          ssh_identity_file=key)
    assert accepting.client.get_transport().is_authenticated()
