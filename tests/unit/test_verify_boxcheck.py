"""The verification suite's own parsers (tests/verify/boxcheck.py), checked without a host
(they decide pass or fail everywhere else). Here, in `make test`, not in `make verify`: a
verification's count is of checks on boxes."""

from __future__ import annotations

import pytest

from tests.verify.boxcheck import (
    SERVICE_PROPERTIES,
    bus_path,
    in_unit_sandbox,
    listeners,
    parse_bytes,
    parse_environment,
    parse_timespan_us,
    split_systemd_words,
)


@pytest.mark.parametrize(("text", "words"), [
    ("A=1 B=2", ["A=1", "B=2"]),
    ('"A=x y" B=2', ["A=x y", "B=2"]),
    (r'"A=say \"hi\" \$HOME \\"', ['A=say "hi" $HOME \\']),
    ("$'A=tab\\there' 'B=it''s'", ["A=tab\there", "B=its"]),
    ("", []),
])
def test_split_systemd_words(text: str, words: list[str]) -> None:
    assert split_systemd_words(text) == words


def test_parse_environment_rejects_repeats() -> None:
    assert parse_environment('X=a:b "Y=c d"') == {"X": "a:b", "Y": "c d"}
    with pytest.raises(ValueError):
        parse_environment("X=1 X=2")


@pytest.mark.parametrize(("text", "usec"), [
    ("1h", 3600 * 10**6), ("3600", 3600 * 10**6), ("1min 30s", 90 * 10**6), ("5s", 5 * 10**6),
    ("100ms", 100_000), ("infinity", None),
])
def test_parse_timespan(text: str, usec: int | None) -> None:
    assert parse_timespan_us(text) == usec


def test_parse_bytes() -> None:
    assert parse_bytes("16G") == parse_bytes("17179869184") == 17179869184
    assert parse_bytes("infinity") is None


def test_bus_path() -> None:
    assert bus_path("vllm-qwen.service") == "/org/freedesktop/systemd1/unit/vllm_2dqwen_2eservice"


def test_listeners() -> None:
    out = ('LISTEN 0 4096 127.0.0.1:18888 0.0.0.0:* users:(("vllm",pid=7,fd=3))\n'
           'LISTEN 0 4096 *:443 *:* users:(("caddy",pid=9,fd=7))\n'
           'LISTEN 0 4096 [::1]:18889 [::]:*\n')
    assert listeners(out) == [("127.0.0.1", 18888, "vllm"), ("*", 443, "caddy"),
                              ("::1", 18889, "?")]


@pytest.mark.parametrize(("setting", "unit_value", "shown"), [
    ("ExecStartPre", "-+/usr/bin/nvidia-modprobe -u -c=0",
     "{ path=/usr/bin/nvidia-modprobe ; argv[]=/usr/bin/nvidia-modprobe -u -c=0 ; "
     "ignore_errors=yes ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; "
     "status=0/0 }"),
    ("SystemCallFilter", "~@mount @reboot @swap", "~mount umount2 reboot swapon swapoff"),
    ("SystemCallErrorNumber", "EPERM", "1"),
    ("RestrictAddressFamilies", "AF_INET AF_UNIX", "AF_UNIX AF_INET"),
    ("BindPaths", "/home/fox", "/home/fox:/home/fox:rbind"),
])
def test_unit_settings_compare_as_systemd_shows_them(setting: str, unit_value: str,
                                                     shown: str) -> None:
    _, normalise = SERVICE_PROPERTIES[setting]
    assert normalise(unit_value) == normalise(shown)


def test_a_missing_syscall_group_is_a_difference() -> None:
    _, normalise = SERVICE_PROPERTIES["SystemCallFilter"]
    assert normalise("~@mount @reboot") != normalise("~mount umount2")


def test_sandboxed_script_keeps_its_dollars() -> None:
    """systemd expands $VAR and $$ in a transient ExecStart: the script goes with `$` doubled."""
    command = in_unit_sandbox(["User=fox"], {"A": "it's"}, 'echo "$HOME" $$x')
    assert command.endswith("""/bin/sh -c 'echo "$$HOME" $$$$x'""")
    assert "-p User=fox" in command and "--setenv='A=it'\"'\"'s'" in command
