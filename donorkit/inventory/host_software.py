"""What the loader derives for a host's software: the oldest NVIDIA driver its card's CUDA (and
its venv's CUDA variant) runs on, and what the venv step checks and installs (requirements,
index arguments, the version vLLM reports)."""

from __future__ import annotations

from donorkit.inventory.card_profiles import variant_cuda
from donorkit.inventory.host_data import CpuHostCard, CudaHostCard
from donorkit.inventory.paths import repo_path
from donorkit.inventory.schema import Settings


class RequirementsFileError(ValueError):
    """A cpu engine's requirements_file cannot be read (the loader names the field)."""


def driver_minimum(minimums: dict[str, str], cuda: str | None,
                   variant: str | None) -> dict[str, str | None]:
    """The oldest driver this box may have (`driver_minimum`) and the CUDA version that sets
    it (`driver_minimum_cuda`): the higher of the toolkit's and the venv's variant's."""
    if not cuda:
        return {"driver_minimum": None, "driver_minimum_cuda": None}
    needs = [(cuda, minimums[cuda])]
    if variant:
        runtime = variant_cuda(variant)
        needs.append((runtime, minimums[runtime]))
    which, minimum = max(needs, key=lambda need: tuple(int(p) for p in need[1].split(".")))
    return {"driver_minimum": minimum, "driver_minimum_cuda": which}


def venv_install(card: CudaHostCard | CpuHostCard, settings: Settings) -> dict:
    """What the venv step checks and what uv installs when a check fails, for one host.

    A card with a `vllm_variant` (cu129) gets vllm and torch <version>+<variant>, from vLLM's
    wheel index for the release (`vllm_variant_index_url`) and the card's extra indexes
    (PyTorch's for that CUDA), as vLLM's variant install does; otherwise vllm and torch from the
    card's index (PyPI's default builds)."""
    version = settings.vllm_version
    if isinstance(card, CpuHostCard):
        return cpu_venv_install(card)
    variant = card.vllm_variant
    tag = f"+{variant}" if variant else ""
    requirements = [f"vllm=={version}{tag}", f"torch=={settings.torch_version}{tag}",
                    *settings.venv_build_packages]
    extra = card.pip_extra_index_urls
    if variant:
        extra = [settings.vllm_variant_index_url.format(version=version, variant=variant), *extra]
    strategy = card.pip_index_strategy
    index_args = ["--index-url", card.pip_index_url,
                  *(arg for url in extra for arg in ("--extra-index-url", url)),
                  *(["--index-strategy", strategy] if strategy else []),
                  *trusted_host_args(card)]
    return {"venv_requirements": requirements, "venv_install_specs": requirements,
            "venv_index_args": index_args, "vllm_installed_version": f"{version}{tag}"}


def trusted_host_args(card: CudaHostCard | CpuHostCard) -> list[str]:
    """pip refuses an index or find-links page over plain http unless its host is trusted."""
    return [arg for h in card.pip_trusted_hosts for arg in ("--trusted-host", h)]


def cpu_venv_install(card: CpuHostCard) -> dict:
    """A cpu engine's venv: its `packages` and every line of its pinned `requirements_file`,
    installed together with --no-deps (the file is the whole closure, minus what it says it
    leaves out); its find-links pages beside the index."""
    path = repo_path(card.requirements_file)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise RequirementsFileError(f"cannot read {path}: {exc.strerror}") from None
    pinned = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    requirements = [*card.packages, *pinned]
    args = ["--no-deps", "--index-url", card.pip_index_url,
            *(arg for url in card.pip_extra_index_urls for arg in ("--extra-index-url", url)),
            *(arg for url in card.pip_find_links for arg in ("--find-links", url)),
            *trusted_host_args(card)]
    # What `vllm --version` and importlib.metadata report for distribution "vllm".
    vllm = next((r for r in card.packages if r.split("==")[0] == "vllm"), "")
    return {"venv_requirements": requirements, "venv_install_specs": requirements,
            "venv_index_args": args, "vllm_installed_version": vllm.split("==")[-1]}
