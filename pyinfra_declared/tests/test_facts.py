"""The generic facts' commands run in a real shell here against real files, and their output
parses; batched reads give each request what its own read gives."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pyinfra_declared.batched_facts import (
    DebStatus,
    EditableInstall,
    GitCheckout,
    PathStates,
    UnitState,
    UserAccount,
    VenvDistributions,
    digest_command,
    shell_glob,
)


def run(command: str) -> list[str]:
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    return result.stdout.splitlines()


def test_shell_glob_quotes_all_but_the_star(tmp_path: Path) -> None:
    odd = tmp_path / "a dir; $(touch pwned)"
    (odd / "lib/python3.12").mkdir(parents=True)
    (odd / "lib/python3.12/x.dist-info").mkdir()
    pattern = shell_glob(f"{odd}/lib/python3*/*.dist-info")
    assert run(f"ls -d {pattern}") == [f"{odd}/lib/python3.12/x.dist-info"]
    assert not (tmp_path / "pwned").exists()


def test_git_checkout_fact_on_a_real_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("1")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    subprocess.run([*git, "tag", "v1.5.1"], check=True)
    fact = GitCheckout()
    state = fact.process(run(fact.command(str(repo), "v1.5.1")))
    assert state["head"] == state["ref"] and len(state["head"]) == 40 and not state["dirty"]
    (repo / "f").write_text("2")
    assert fact.process(run(fact.command(str(repo), "v1.5.1")))["dirty"] is True
    assert fact.process(run(fact.command(str(tmp_path / "absent"), "v1.5.1")))["head"] is None


def test_editable_install_fact_finds_direct_url(tmp_path: Path) -> None:
    dist = tmp_path / "venv/lib/python3.11/site-packages/vllm_exl3-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "direct_url.json").write_text(
        '{"url": "file:///opt/uncloseai/src/vllm-exl3", "dir_info": {"editable": true}}')
    fact = EditableInstall()
    assert fact.process(run(fact.command(str(tmp_path / "venv"), "/opt/uncloseai/src/vllm-exl3")))
    assert not fact.process(run(fact.command(str(tmp_path / "venv"), "/opt/elsewhere")))


def test_dependency_digest_changes_with_content_and_presence(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site/vllm-0.26.0.dist-info").mkdir()
    unit = tmp_path / "unit"
    unit.write_text("a")
    paths = [str(unit), f"{tmp_path}/site/*.dist-info", f"{tmp_path}/stamp"]
    first = run(digest_command(paths))
    assert first == run(digest_command(paths)) and len(first[0]) == 64
    (tmp_path / "site/torch-2.11.0.dist-info").mkdir()
    second = run(digest_command(paths))
    assert second != first
    (tmp_path / "stamp").write_text("k")
    third = run(digest_command(paths))
    assert third != second
    unit.write_text("b")
    assert run(digest_command(paths)) != third


def test_deb_status_names_installed_packages_only() -> None:
    fact = DebStatus()
    output = run(fact.command(["dpkg", "no-such-package-uncloseai"]) + "; echo status=$?")
    assert output[-1] == "status=0"  # an unknown package is an answer, not a failure
    assert fact.process(output[:-1]) == {"dpkg"}  # Debian here
    assert fact.process(["ii  git", "rc  caddy", "iU  ninja-build", "hi  curl"]) == {"git", "curl"}
    requests = [{"packages": ["dpkg", "no-such-package-uncloseai"]}, {"packages": ["dpkg", "tar"]},
                {"packages": ["no-such-package-uncloseai"]}]
    batched = fact.batch_process(run(fact.batch_command(requests)), requests)
    assert batched == [fact.process(run(fact.command(**kwargs))) for kwargs in requests]
    assert batched == [{"dpkg"}, {"dpkg", "tar"}, set()]


def test_path_states_reads_type_owner_mode_and_digest_in_one_command(tmp_path: Path) -> None:
    conf, folder = tmp_path / "x.conf", tmp_path / "bin"
    conf.write_text("hello\n")
    conf.chmod(0o640)
    folder.mkdir()
    folder.chmod(0o750)
    (tmp_path / "link").symlink_to(conf)
    paths = [str(conf), str(folder), str(tmp_path / "link"), str(tmp_path / "absent")]
    fact = PathStates()
    states = fact.process(run(fact.command(paths, digest=[str(conf), str(tmp_path / "absent")])))
    assert set(states) == {str(conf), str(folder), str(tmp_path / "link")}
    assert states[str(conf)] == {
        "type": "regular file", "user": "root", "group": "root", "mode": "640",
        "sha256": "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"}
    assert states[str(folder)]["type"] == "directory" and states[str(folder)]["mode"] == "750"
    assert states[str(tmp_path / "link")]["type"] == "symbolic link"


def test_user_account_reads_passwd_and_home_owner(tmp_path: Path) -> None:
    fact = UserAccount()
    root = fact.process(run(fact.command("root")))
    assert root == {"home": "/root", "shell": root["shell"], "home_owner": "root"}
    assert fact.process(run(fact.command("no-such-user-uncloseai"))) is None


def test_venv_distributions_from_dist_info_names(tmp_path: Path) -> None:
    site = tmp_path / "venv/lib/python3.11/site-packages"
    for name in ("torch-2.11.0+cu130.dist-info", "typing_extensions-4.16.0.dist-info",
                 "PyYAML-6.0.4.dist-info", "torch", "exllamav3_ext.so"):
        (site / name).mkdir(parents=True)
    fact = VenvDistributions()
    assert fact.process(run(fact.command(str(tmp_path / "venv")))) == {
        "torch": "2.11.0+cu130", "typing-extensions": "4.16.0", "pyyaml": "6.0.4"}
    assert fact.process(run(fact.command(str(tmp_path / "absent")))) == {}


def test_unit_state_reports_a_present_file(tmp_path: Path) -> None:
    marker = tmp_path / "reload-pending"
    fact = UnitState()
    command = fact.command("no-such.service", present=str(marker))
    assert "Present" not in fact.process(run(command))
    marker.touch()
    assert fact.process(run(command))["Present"] == "yes"


def test_path_states_batched_answers_each_request_as_its_own_read(tmp_path: Path) -> None:
    """The snapshot's one stat + sha256sum for many requests (snapshot.py) must give
    each request exactly what its own command gives: its paths only, sha256 only if asked."""
    conf, key, folder = tmp_path / "x.conf", tmp_path / "x.key", tmp_path / "bin"
    conf.write_text("hello\n")
    key.write_text("secret\n")
    folder.mkdir()
    absent = str(tmp_path / "absent")
    requests = [{"paths": [str(conf)], "digest": [str(conf)]},
                {"paths": [str(conf), str(folder), absent]},  # same file, no digest asked
                {"paths": [str(key), absent], "digest": [str(key), absent]},
                {"paths": [absent]}]
    fact = PathStates()
    batched = fact.batch_process(run(fact.batch_command(requests)), requests)
    alone = [fact.process(run(fact.command(**kwargs))) for kwargs in requests]
    assert batched == alone
    assert "sha256" in batched[0][str(conf)] and "sha256" not in batched[1][str(conf)]
    assert batched[3] == {}


def test_unit_state_batched_answers_each_unit_or_refuses() -> None:
    """One `systemctl show` for many units: each unit's value is what its own command gives.
    Without systemd as PID 1 (this machine) systemctl prints nothing: the batch must refuse
    (the snapshot then reads each unit on its own) rather than answer with missing states.
    Against real systemd the batch is also checked on the testbed
    (tests/testbed/fleet/test_idempotence.py)."""
    requests = [{"unit": "caddy", "present": "/etc/passwd"},
                {"unit": "vllm-qwen.service", "depends_on": ["/etc/hostname"], "record": "/no"}]
    fact = UnitState()
    output = run(fact.batch_command(requests))
    assert output.count("@@pyinfra-snapshot-unit") == 2
    if Path("/run/systemd/system").exists():  # systemd runs here
        assert fact.batch_process(output, requests) == [
            fact.process(run(fact.command(**kwargs))) for kwargs in requests]
    else:
        with pytest.raises(ValueError, match="one block per unit"):
            fact.batch_process(output, requests)
    shown = ["LoadState=loaded", "ActiveState=active", "", "LoadState=not-found",
             "ActiveState=inactive", "@@pyinfra-snapshot-unit", "OnDisk=a", "Recorded=a",
             "@@pyinfra-snapshot-unit", "OnDisk=b", "Recorded=", "Present=yes"]
    assert fact.batch_process(shown, requests) == [
        {"LoadState": "loaded", "ActiveState": "active", "OnDisk": "a", "Recorded": "a"},
        {"LoadState": "not-found", "ActiveState": "inactive", "OnDisk": "b", "Recorded": "",
         "Present": "yes"}]


def test_text_files_in_one_command(tmp_path: Path) -> None:
    """Each file's lines as `cat` gives them, the last line ended or not; an absent file left
    out; a line that looks like a header of another fact is just a line."""
    from pyinfra_declared.batched_facts import TextFiles

    (tmp_path / "a").write_text("one\n@@two\n")
    (tmp_path / "b b").write_text("no newline at the end")
    paths = [str(tmp_path / "a"), str(tmp_path / "b b"), str(tmp_path / "absent")]
    fact = TextFiles()
    assert fact.process(run(fact.command(paths))) == {
        paths[0]: ["one", "@@two"], paths[1]: ["no newline at the end"]}
