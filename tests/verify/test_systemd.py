"""The model units as systemd loaded them (systemctl show / D-Bus, never a grep of the file)."""

from __future__ import annotations

from pathlib import PurePosixPath

from boxcheck import (
    SERVICE_PROPERTIES,
    expected_environment,
    live_unit_environment,
    need_systemd,
    unit_argv,
    unit_show,
)
from testinfra.host import Host

from donorkit.box.serving import hf_token_path, home_token_path
from donorkit.inventory.host_data import DonorBox, ServedModel
from donorkit.render import templates as render


def test_unit_enabled(host: Host, m: ServedModel) -> None:
    unit_show(host, m.unit)
    state = host.run("systemctl is-enabled %s", m.unit).stdout.strip()
    assert state == "enabled", f"{m.unit} is {state!r}"


def test_unit_active(host: Host, m: ServedModel) -> None:
    """Restart=always hides a crash loop as "activating (auto-restart)"; active means running."""
    state = unit_show(host, m.unit, "ActiveState", "SubState")
    assert (state["ActiveState"], state["SubState"]) == ("active", "running"), (
        f"{m.unit} is {state['ActiveState']} ({state['SubState']}): "
        f"see journalctl -u {m.unit}")


def test_unit_environment(host: Host, data: DonorBox, m: ServedModel) -> None:
    unit_show(host, m.unit)
    live = live_unit_environment(host, m.unit)
    want = expected_environment(data, m)
    extra = {k: v for k, v in live.items() if k not in want}
    absent = {k: v for k, v in want.items() if k not in live}
    wrong = {k: (live[k], v) for k, v in want.items() if k in live and live[k] != v}
    assert not (extra or absent or wrong), (
        f"Environment of {m.unit} differs from the inventory:\n"
        f"  unexpected: {extra}\n  missing: {absent}\n  (live, expected): {wrong}")


def test_unit_user(host: Host, data: DonorBox, m: ServedModel) -> None:
    assert unit_show(host, m.unit, "User")["User"] == data.service_user


def test_unit_service_setting(host: Host, data: DonorBox, m: ServedModel, setting: str) -> None:
    """One [Service] setting of unit_service, compared as systemd normalises it."""
    prop, normalise = SERVICE_PROPERTIES.get(setting, (setting, str))
    live = unit_show(host, m.unit, prop).get(prop)
    want = str(data.unit_service[setting])
    assert live is not None, f"systemd reports no {prop} for {m.unit}"
    assert normalise(live) == normalise(want), f"{prop}={live}, inventory {setting}={want}"


def test_unit_exec_start(host: Host, data: DonorBox, m: ServedModel) -> None:
    argv = unit_argv(host, m.unit)
    assert argv == render.exec_start(data, m)


def test_unit_binds_loopback_without_alias(host: Host, m: ServedModel) -> None:
    """vLLM listens on all interfaces unless --host is given; an alias hides the checkpoint."""
    argv = unit_argv(host, m.unit)
    hosts = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--host"]
    hosts += [a.split("=", 1)[1] for a in argv if a.startswith("--host=")]
    assert hosts == ["127.0.0.1"], f"--host values in ExecStart: {hosts}"
    assert not [a for a in argv if a.split("=")[0] == "--served-model-name"], argv


def test_caddy_active(host: Host) -> None:
    need_systemd(host, "caddy.service")
    unit_show(host, "caddy.service")
    state = host.run("systemctl is-active caddy.service").stdout.strip()
    assert state == "active", f"caddy.service is {state!r}"


def test_caddy_enabled(host: Host) -> None:
    unit_show(host, "caddy.service")
    state = host.run("systemctl is-enabled caddy.service").stdout.strip()
    assert state == "enabled", f"caddy.service is {state!r}"


def test_retired_units_gone(host: Host, data: DonorBox) -> None:
    """Units of identities this box no longer serves must not hold the GPU."""
    need_systemd(host, "retired model units")
    for unit in data.retired_units:
        state = host.run("systemctl show -p LoadState -p ActiveState %s", unit).stdout
        assert "LoadState=loaded" not in state, f"{unit} is still installed: {state.split()}"


def test_unit_leaves_the_gpu_devices_open(host: Host, m: ServedModel) -> None:
    """The sandbox must not close the device list (DeviceAllow=, or ProtectClock= which implies
    one): /dev/nvidia* would be refused and CUDA would see no GPU."""
    state = unit_show(host, m.unit, "DevicePolicy", "DeviceAllow", "PrivateDevices")
    # systemctl show leaves an empty DeviceAllow out.
    assert (state["DevicePolicy"], state.get("DeviceAllow", ""), state["PrivateDevices"]) == (
        "auto", "", "no"), f"{m.unit}: {state}"


def test_unit_is_sandboxed(host: Host, m: ServedModel) -> None:
    """The hardening of defaults.yml, as systemd loaded it."""
    state = unit_show(host, m.unit, "NoNewPrivileges", "ProtectSystem", "ProtectHome",
                      "CapabilityBoundingSet", "PrivateTmp", "RestrictNamespaces")
    assert (state["NoNewPrivileges"], state["ProtectSystem"], state["ProtectHome"],
            state["CapabilityBoundingSet"], state["PrivateTmp"]) == (
        "yes", "strict", "tmpfs", "", "yes"), f"{m.unit}: {state}"


def test_hf_token_only_where_root_alone_reads_it(host: Host, data: DonorBox) -> None:
    """Issue 21, hole 8. The service user's home is the vLLM units': no token there. With a
    token in the inventory it is root's, 0600 in a 0700 folder of root's, and the service user
    (each vLLM unit's User=) cannot open it (the weights step's root shell hands it to the fetch
    on stdin); without one, there is none on the box either."""
    home_copy = home_token_path(data.service_home)
    assert not host.file(home_copy).exists, f"{home_copy}: a token in the service user's home"
    token = host.file(hf_token_path(data.install_root))
    if not data.hf_token_file:
        assert not token.exists, f"{token.path}: a token on the box, none in the inventory"
        return
    folder = host.file(str(PurePosixPath(token.path).parent))
    assert (token.user, token.group, token.mode) == ("root", "root", 0o600), token.path
    assert (folder.user, folder.group, folder.mode) == ("root", "root", 0o700), folder.path
    tried = host.run("runuser -u %s -- cat %s", data.service_user, token.path)
    assert tried.rc != 0 and "Permission denied" in tried.stderr, (tried.rc, tried.stderr)
