"""Render every file the deploy writes to a host. `make render` and the deploy both call this."""

from __future__ import annotations

import functools
import os
import re
import stat
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import jinja2

from donorkit.inventory.errors import DonorsError
from donorkit.inventory.host_data import DonorBox, EdgeBox, ServedModel
from donorkit.inventory.paths import REPO_ROOT, pki_dir
from donorkit.inventory.pki import OPERATOR_CLIENT, Pki
from donorkit.inventory.values import caddy_duration

TEMPLATES = REPO_ROOT / "templates"
UNIT_DIR = "/etc/systemd/system"
# The stamp of the plugin's shipped source tree (its digest; in the units' restart digest) and
# the marker of a venv install under way: names on the boxes, kept as the first deploys made them.
PLUGIN_TREE_STAMP = ".uncloseai-tree"
VENV_BUSY_MARKER = ".uncloseai-installing"
CADDYFILE = "/etc/caddy/Caddyfile"
CADDY_DROP_IN = f"{UNIT_DIR}/caddy.service.d/uncloseai.conf"
# {path} is the staged unit, named like the installed one (systemd-analyze reads the suffix).
# Refused: a non-zero exit (fatal errors) or any line about the unit itself (ignored settings).
VERIFY_UNIT = ("out=$(systemd-analyze verify --man=no {path} 2>&1); rc=$?; "
               "printf '%s\\n' \"$out\" >&2; "
               "[ $rc -eq 0 ] && ! printf '%s' \"$out\" | grep -qF {path}")


@dataclass(frozen=True)
class RenderedFile:
    path: str
    content: str
    mode: str = "644"
    user: str = "root"
    group: str = "root"


# Words systemd reads as they are: anything else is quoted (systemd_quote).
_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:,+@=-]+")


def systemd_specifiers(text: str) -> str:
    """`%` starts a specifier (%h, %n, ...) in every unit setting: `%%` is a literal `%`."""
    return text.replace("%", "%%")


def systemd_quote(text: str) -> str:
    """One word of a unit setting, exactly as given: inside double quotes systemd undoes C
    escapes, so `\\` and `"` are escaped; `%` is doubled (specifiers, expanded on the whole line
    before any quoting is read). Newlines and other control characters are refused by the schema
    (donorkit/inventory/values.py) and here."""
    if any(unicodedata.category(c) == "Cc" for c in text):
        raise ValueError(f"control character in {text!r}: a unit word cannot carry it")
    if _PLAIN_WORD.fullmatch(text):
        return text
    return '"' + systemd_specifiers(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


def systemd_arg(value: object) -> str:
    """One ExecStart word: quoted as systemd_quote, and `$` doubled (ExecStart expands $VAR and
    ${VAR} in every word, quoted or not; `$$` is a literal `$`)."""
    text = str(value)
    quoted = systemd_quote(text)
    return quoted.replace("$", "$$")


def systemd_command(words: list[str]) -> str:
    """ExecStart's value: one `--flag value` per continuation line, each word quoted as needed."""
    lines: list[list[str]] = [[]]
    for word in words:
        if word.startswith("--"):
            lines.append([])
        lines[-1].append(systemd_arg(word))
    return " \\\n    ".join(" ".join(line) for line in lines if line)


def systemd_env(key: str, value: object) -> str:
    """One Environment= assignment: the whole `KEY=value` is one word (no `$` expansion here)."""
    return systemd_quote(f"{key}={value}")


def _one_line(text: str, where: str) -> str:
    """Refuse what would end a line, continue it, or hide what it says."""
    if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in text) or "\\" in text:
        raise ValueError(f"{text!r}: control characters and backslashes cannot be in {where}")
    return text


def systemd_value(value: object) -> str:
    """A [Service] value from unit_service: systemd syntax as written (booleans as yes/no); the
    schema's UnitService allow-list says which values; nothing here can end or continue the
    line."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return _one_line(str(value), "a unit setting")


def systemd_text(value: object) -> str:
    """Free text in a unit setting (Description=): on one line, `%` doubled (specifiers)."""
    return systemd_specifiers(_one_line(str(value), "a unit setting"))


def systemd_word(value: object) -> str:
    """A value systemd must read as one plain word (User=, a key, a port)."""
    text = str(value)
    if not _PLAIN_WORD.fullmatch(text):
        raise ValueError(f"{text!r} is not a plain word a unit line can hold")
    return text


def unit_comment(value: object) -> str:
    return _one_line(str(value), "a comment")


# A Caddyfile token left bare: nothing the lexer reads as syntax (quotes, braces, `#`, `<<`,
# whitespace); a placeholder only in its plain form. Anything else is quoted (caddy_token).
_CADDY_BARE = re.compile(r"[A-Za-z0-9_./:@>,=+~\[\]-]+|\{[a-z][a-z0-9_.]*\}")


def caddy_token(value: object, quote: bool = False) -> str:
    """One Caddyfile token, exactly as given: bare when plain (and not `quote`), else in double
    quotes with `"` escaped. Refused: what no quoting can carry (control characters: a newline
    would end the directive; a backslash: Caddy keeps it, except before `"`; `{$`: Caddy
    substitutes an environment variable there before it reads any token)."""
    text = str(value)
    if (any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in text)
            or "\\" in text or "{$" in text or not text):
        raise ValueError(f"{text!r} cannot be a Caddyfile token (control characters, "
                         "backslashes, '{$' or nothing)")
    if _CADDY_BARE.fullmatch(text) and not quote:
        return text
    return '"' + text.replace('"', '\\"') + '"'


def caddy_comment(value: object) -> str:
    """A value in a Caddyfile comment: on its line, and no `{$` (substituted even there)."""
    text = _one_line(str(value), "a Caddyfile comment")
    if "{$" in text:
        raise ValueError(f"{text!r}: '{{$' cannot be in a Caddyfile")
    return text


@functools.cache
def jinja_environment() -> jinja2.Environment:
    """One per process, so each template is compiled once, not once per host."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["systemd_command"] = systemd_command
    env.filters["systemd_value"] = systemd_value
    env.filters["systemd_text"] = systemd_text
    env.filters["systemd_word"] = systemd_word
    env.filters["unit_comment"] = unit_comment
    env.filters["caddy"] = caddy_token
    env.filters["caddy_comment"] = caddy_comment
    env.filters["caddy_duration"] = caddy_duration
    env.filters["systemd_specifiers"] = systemd_specifiers
    env.globals["systemd_env"] = systemd_env
    return env


def cuda_paths(data: DonorBox) -> dict[str, str]:
    """The CUDA part of a unit's environment; the venv's bin/ first (FlashInfer runs bare ninja).
    A cpu engine has no toolkit: only the PATH."""
    cuda = data.cuda_home
    if cuda is None:
        return {"PATH": f"{data.venv_dir}/bin:/usr/bin:/bin"}
    return {
        "CUDA_HOME": cuda,
        "PATH": f"{data.venv_dir}/bin:{cuda}/bin:{cuda}/nvvm/bin:/usr/bin:/bin",
        "CPATH": f"{cuda}/include",
        "LIBRARY_PATH": f"{cuda}/lib64",
        "LD_LIBRARY_PATH": f"{cuda}/lib64",
    }


def hf_home(home: str) -> str:
    """huggingface_hub's home for a user (HF_HOME): where the weights step runs the fetcher."""
    return f"{home}/.cache/huggingface"


def hub_cache(home: str) -> str:
    """huggingface_hub's cache under a user's HF_HOME: the weights step fills it, the units'
    vLLM reads it (HF_HUB_CACHE). The one place this path is spelt."""
    return f"{hf_home(home)}/hub"


def hub_environment(data: DonorBox) -> dict[str, str]:
    """The weights are in the service user's cache before a unit starts (tasks/weights.py):
    vLLM reads them there and never asks the hub, so a restart never waits on it."""
    return {"HF_HUB_CACHE": hub_cache(data.service_home), "HF_HUB_OFFLINE": "1"}


def unit_environment(data: DonorBox, model: ServedModel) -> dict[str, str]:
    """Everything a model's unit sets with Environment=, in order."""
    return {**cuda_paths(data), **hub_environment(data), **data.unit_environment,
            **model.environment}


def pinned_revision(model: ServedModel) -> list[str]:
    """vLLM's flags for the fetched commit (a local-path checkpoint has none)."""
    revision = model.revision
    if not revision or model.checkpoint.startswith("/"):
        return []
    return ["--revision", revision, "--tokenizer-revision", revision]


def exec_start(data: DonorBox, model: ServedModel) -> list[str]:
    return [data.vllm_executable, "serve", model.checkpoint,
            "--host", "127.0.0.1", "--port", str(model.port),
            "--max-model-len", str(model.max_model_len), *pinned_revision(model),
            *model.args, *map(str, data.card.vllm_args)]


def render_unit(data: DonorBox, model: ServedModel) -> str:
    return jinja_environment().get_template("vllm.service.j2").render(
        dict(data), model=model, environment=unit_environment(data, model),
        exec_start=exec_start(data, model))


def tls_paths(data: DonorBox | EdgeBox) -> tuple[str, str]:
    tls_dir, name = data.caddy_tls_dir, data.name
    return f"{tls_dir}/{name}.crt", f"{tls_dir}/{name}.key"


def client_ca_path(data: DonorBox) -> str:
    """On a donor: the CA whose client certificates (the edges') its Caddy accepts."""
    return f"{data.caddy_tls_dir}/client-ca.crt"


def trusted_client_files(data: DonorBox) -> dict[str, str]:
    """On a donor: {path: certificate PEM} of every client certificate its Caddy accepts: the
    current edges' and the operator's (fleet.py's `trusted_clients`; a client's previous
    certificate too while it is valid, Pki.trusted_pems), one file each: Caddy's
    `trusted_leaf_cert_file` reads the first certificate of a file."""
    pki = pki_for(data)
    return {f"{data.caddy_tls_dir}/client-{name}{'.prev' if n else ''}.crt": pem
            for name in data.trusted_clients
            for n, pem in enumerate(pki.trusted_pems(name))}


# Sent by an edge's health checks only (a client's copy is dropped by the edge): the donor's
# Caddy fails these checks while its drain flag exists (the rolling rollout,
# donorkit/commands/rollout.py).
EDGE_HEALTH_HEADER = "X-Uncloseai-Edge-Health"


def drain_flag(data: DonorBox) -> str:
    """On a donor: the file whose existence takes the box out of every edge's pool (the edges'
    health checks get 503). The rolling rollout creates it; the deploy's last step removes it."""
    return f"{data.install_root}/state/drained"


def render_caddyfile(data: DonorBox) -> str:
    cert, key = tls_paths(data)
    flag = Path(drain_flag(data))
    return jinja_environment().get_template("Caddyfile.j2").render(
        dict(data), tls_cert=cert, tls_key=key, client_ca=client_ca_path(data),
        trusted_leafs=list(trusted_client_files(data)),
        edge_health_header=EDGE_HEALTH_HEADER, drain_flag_dir=str(flag.parent),
        drain_flag_name=flag.name, operator_client_subject=f"CN={OPERATOR_CLIENT}",
        caddy_bind=caddy_bind(data))


def caddy_bind(data: DonorBox) -> list[str]:
    """Where a donor's Caddy listens: everywhere when the edges reach it directly; a tunnelled
    donor's on its tunnel address and loopback only, never its home network's interfaces."""
    return [data.tunnel.address, "127.0.0.1"] if data.tunnel else []


def edge_paths(data: EdgeBox) -> dict[str, str]:
    """On an edge: our CA (verifies donors), its client pair, its public pair (private_ca)."""
    tls_dir, name = data.caddy_tls_dir, data.edge_name
    cert, key = tls_paths(data)
    return {"ca": f"{tls_dir}/ca.crt", "client_cert": f"{tls_dir}/{name}-client.crt",
            "client_key": f"{tls_dir}/{name}-client.key", "public_cert": cert, "public_key": key}


def health_body(checkpoint: str) -> str:
    """A regular expression (Go's) matching the checkpoint literally, without backslashes (a
    Caddyfile token keeps them, Go would read them): each `.` as `[.]`. The schema allows
    letters, digits, `._-/` in a checkpoint id; `-` and `/` are literal in Go outside a class."""
    return checkpoint.replace(".", "[.]")


# What the public sites pass to the donors (vLLM 0.26.0's OpenAI API, its version, health and
# API docs); everything else gets 404 at the edge. /docs loads /openapi.json from the same origin
# (and /docs/oauth2-redirect); its script and style come from a CDN unless vLLM runs with
# --enable-offline-docs, which serves these two under /static/ (read from vLLM 0.26.0's wheel).
EDGE_PUBLIC_PATHS = ("/v1/*", "/version", "/health", "/docs", "/docs/*", "/openapi.json",
                     "/static/swagger-ui-bundle.js", "/static/swagger-ui.css")


def render_edge_caddyfile(data: EdgeBox) -> str:
    return jinja_environment().get_template("Caddyfile-edge.j2").render(
        dict(data), paths=edge_paths(data), health_body=health_body,
        edge_health_header=EDGE_HEALTH_HEADER, edge_public_paths=EDGE_PUBLIC_PATHS)


def render_caddy_drop_in(data: DonorBox | EdgeBox) -> str:
    """caddy.service's drop-in: the directory of the admin socket, entered by root and caddy only
    (the distro's unit has none; Caddy does not create it)."""
    socket_dir = str(Path(data.caddy_admin_socket).parent)  # /run/<dir>: the schema's shape
    tunnel = data.tunnel if isinstance(data, DonorBox) else None
    # A tunnelled donor's Caddy binds the tunnel address: the tunnel comes up first.
    after = (f"[Unit]\nWants=wg-quick@{tunnel.interface}.service\n"
             f"After=wg-quick@{tunnel.interface}.service\n" if tunnel else "")
    return ("# Managed by the uncloseai donor deploy. The admin API's socket lives here:\n"
            "# only root and caddy may enter (mode 0750, caddy:caddy from User=/Group=).\n"
            f"{after}[Service]\n"
            f"RuntimeDirectory={socket_dir.removeprefix('/run/')}\n"
            "RuntimeDirectoryMode=0750\n")


def pki_for(data: DonorBox | EdgeBox) -> Pki:
    return Pki(pki_dir(data), data.pki_renew_days)


def render_host(data: DonorBox | EdgeBox) -> list[RenderedFile]:
    """Every file the deploy writes for this host (units, Caddyfile, TLS pair; an edge's own)."""
    if isinstance(data, EdgeBox):
        return render_edge(data)
    return [*(RenderedFile(f"{UNIT_DIR}/{m.unit}", render_unit(data, m))
              for m in data.models.values()), *render_caddy(data)]


def render_caddy(data: DonorBox) -> list[RenderedFile]:
    """A donor's Caddy files: its TLS pair, the client CA and certificates it accepts, the
    admin socket's drop-in, the Caddyfile (tasks/caddy.py installs these)."""
    pki = pki_for(data)
    files = []
    cert_pem, key_pem = pki.server_cert(data.donor_name, [r.hostname for r in data.routes])
    cert, key = tls_paths(data)
    # The TLS files come before the Caddyfile: validating the Caddyfile reads them.
    files.append(RenderedFile(cert, cert_pem))
    files.append(RenderedFile(key, key_pem, mode="640", group="caddy"))
    files.append(RenderedFile(client_ca_path(data), pki.client_ca_pem()))
    files += [RenderedFile(path, pem) for path, pem in trusted_client_files(data).items()]
    files.append(RenderedFile(CADDY_DROP_IN, render_caddy_drop_in(data)))
    files.append(RenderedFile(CADDYFILE, render_caddyfile(data)))
    return files


def render_edge(data: EdgeBox) -> list[RenderedFile]:
    """Every file the deploy writes to an edge: our CA, its client pair (from the client CA), its
    public pair when edge_public_tls is private_ca, the admin socket drop-in, the Caddyfile.
    Keys 0640 root:caddy."""
    pki, paths = pki_for(data), edge_paths(data)
    # Not renewed here: a donor's deploy does, so the donors trust it before the edge presents it.
    client_pem, client_key_pem = pki.client_cert(data.edge_name, renew=False)
    files = [RenderedFile(paths["ca"], pki.ca_pem()),
             RenderedFile(paths["client_cert"], client_pem),
             RenderedFile(paths["client_key"], client_key_pem, mode="640", group="caddy")]
    if data.public_tls == "private_ca":
        cert_pem, key_pem = pki.server_cert(data.edge_name,
                                            [site.hostname for site in data.sites])
        files.append(RenderedFile(paths["public_cert"], cert_pem))
        files.append(RenderedFile(paths["public_key"], key_pem, mode="640", group="caddy"))
    files.append(RenderedFile(CADDY_DROP_IN, render_caddy_drop_in(data)))
    files.append(RenderedFile(CADDYFILE, render_edge_caddyfile(data)))
    return files


class OutExists(DonorsError):
    """`make render`'s OUT is already there (one line for the operator)."""


def write_tree(files: list[RenderedFile], out: Path) -> list[Path]:
    """Lay rendered files out under `out` as on the box. `out` is made here, mode 0700, and must
    not exist in any form (folder, file, link): private keys are never written through a path
    someone else prepared (a planted file they can read, a link that sends root's write
    elsewhere). Inside it, every folder and file is created new (O_EXCL), links never followed
    (O_NOFOLLOW), each opened from its parent's descriptor."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(out, 0o700)  # EEXIST for any existing entry, a dangling link included
    except FileExistsError:
        raise OutExists(f"{out} already exists: name a new directory (render makes it, private, "
                        "and never writes through an existing path)") from None
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    root = os.open(out, os.O_RDONLY | os.O_DIRECTORY | nofollow)
    written = []
    try:
        made = os.fstat(root)
        if made.st_uid != os.geteuid() or stat.S_IMODE(made.st_mode) & 0o077:
            raise OutExists(f"{out} is not the private directory render just made")
        for item in files:
            *folders, name = item.path.strip("/").split("/")
            if any(part in ("", ".", "..") for part in [*folders, name]):
                raise ValueError(f"rendered path {item.path!r} is not a plain absolute path")
            parent = os.dup(root)
            try:
                for folder in folders:
                    try:
                        os.mkdir(folder, 0o700, dir_fd=parent)
                    except FileExistsError:
                        pass  # made by this loop for an earlier file: opened without following
                    child = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | nofollow,
                                    dir_fd=parent)
                    os.close(parent)
                    parent = child
                mode = int(item.mode, 8)
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow, mode,
                             dir_fd=parent)
                with os.fdopen(fd, "w") as handle:
                    os.fchmod(handle.fileno(), mode)  # the umask may have taken bits off
                    handle.write(item.content)
            finally:
                os.close(parent)
            written.append(out.joinpath(*folders, name))
    finally:
        os.close(root)
    return written
