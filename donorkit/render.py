"""Render every file the deploy writes to a host. `make render` and the deploy both call this."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import jinja2

from donorkit.paths import REPO_ROOT, repo_path
from donorkit.pki import Pki

TEMPLATES = REPO_ROOT / "templates"
UNIT_DIR = "/etc/systemd/system"
CADDYFILE = "/etc/caddy/Caddyfile"


@dataclass(frozen=True)
class RenderedFile:
    path: str
    content: str
    mode: str = "644"
    user: str = "root"
    group: str = "root"


def systemd_arg(value: object) -> str:
    """Quote one ExecStart word: JSON goes in single quotes (systemd strips bare double quotes)."""
    text = str(value)
    if text[:1] in "{[" or any(c in text for c in " \t\"\\"):
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


def systemd_command(words: list[str]) -> str:
    """ExecStart's value: one `--flag value` per continuation line, each word quoted as needed."""
    lines: list[list[str]] = [[]]
    for word in words:
        if word.startswith("--"):
            lines.append([])
        lines[-1].append(systemd_arg(word))
    return " \\\n    ".join(" ".join(line) for line in lines)


def systemd_env(key: str, value: object) -> str:
    """One Environment= assignment, quoted when the value needs it."""
    text = f"{key}={value}"
    return f'"{text}"' if any(c in text for c in " \t\"\\") else text


@functools.cache
def _environment() -> jinja2.Environment:
    """One per process, so each template is compiled once, not once per host."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["systemd_command"] = systemd_command
    env.globals["systemd_env"] = systemd_env
    return env


def cuda_paths(data: dict) -> dict[str, str]:
    """The CUDA part of a unit's environment; the venv's bin/ first (FlashInfer runs bare ninja)."""
    cuda = data["cuda_home"]
    return {
        "CUDA_HOME": cuda,
        "PATH": f"{data['venv_dir']}/bin:{cuda}/bin:{cuda}/nvvm/bin:/usr/bin:/bin",
        "CPATH": f"{cuda}/include",
        "LIBRARY_PATH": f"{cuda}/lib64",
        "LD_LIBRARY_PATH": f"{cuda}/lib64",
    }


def unit_environment(data: dict, model: dict) -> dict[str, str]:
    """Everything a model's unit sets with Environment=, in order."""
    return {**cuda_paths(data), **data["unit_environment"], **model["environment"]}


def exec_start(data: dict, model: dict) -> list[str]:
    return [data["vllm_executable"], "serve", model["checkpoint"],
            "--host", "127.0.0.1", "--port", str(model["port"]),
            "--max-model-len", str(model["max_model_len"]), *map(str, model["args"])]


def render_unit(data: dict, model: dict) -> str:
    return _environment().get_template("vllm.service.j2").render(
        data, model=model, environment=unit_environment(data, model),
        exec_start=exec_start(data, model))


def tls_paths(data: dict) -> tuple[str, str]:
    tls_dir, name = data["caddy_tls_dir"], data["donor_name"]
    return f"{tls_dir}/{name}.crt", f"{tls_dir}/{name}.key"


def render_caddyfile(data: dict) -> str:
    cert, key = tls_paths(data)
    return _environment().get_template("Caddyfile.j2").render(data, tls_cert=cert, tls_key=key)


def pki_for(data: dict) -> Pki:
    return Pki(repo_path(data["pki_dir"]), data["pki_renew_days"])


def render_host(data: dict) -> list[RenderedFile]:
    """Every file the deploy writes for this host (units, Caddyfile, TLS pair)."""
    files = [RenderedFile(f"{UNIT_DIR}/{m['unit']}", render_unit(data, m))
             for m in data["models"].values()]
    cert_pem, key_pem = pki_for(data).server_cert(
        data["donor_name"], [r["hostname"] for r in data["routes"]])
    cert, key = tls_paths(data)
    # The TLS pair comes before the Caddyfile: validating the Caddyfile reads them.
    files.append(RenderedFile(cert, cert_pem))
    files.append(RenderedFile(key, key_pem, mode="640", group="caddy"))
    files.append(RenderedFile(CADDYFILE, render_caddyfile(data)))
    return files


def write_tree(files: list[RenderedFile], out: Path) -> list[Path]:
    """Lay rendered files out under `out` as on the box."""
    written = []
    for item in files:
        target = out / item.path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(item.content)
        target.chmod(int(item.mode, 8))
        written.append(target)
    return written
