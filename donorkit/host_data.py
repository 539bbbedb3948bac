"""What the loader (donorkit.fleet) hands the deploy for each host beyond the merged settings of
defaults.yml, as types: the card profile the box has (a discriminated union on its engine, with
its name), read as fields (`host.data.card.engine`, `card.arch`) by the tasks, the rendering, the
acceptance run and the verification suite."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Tag

from donorkit.schema import CpuCard, CudaCard, engine_tag
from donorkit.values import Name


class _AsPyinfraData:
    def to_json(self) -> Any:
        """pyinfra's CLI shows host data as JSON (`debug-inventory`): it asks this method."""
        return self.model_dump(mode="json")  # type: ignore[attr-defined]


class CudaHostCard(_AsPyinfraData, CudaCard):
    """A GPU box's card profile, with the name it has in defaults.yml `cards:`."""

    name: Name


class CpuHostCard(_AsPyinfraData, CpuCard):
    """vLLM's CPU engine's profile, with its name."""

    name: Name


HostCard = Annotated[Annotated[CudaHostCard, Tag("engine=cuda")]
                     | Annotated[CpuHostCard, Tag("engine=cpu")], Discriminator(engine_tag)]


def host_card(name: str, card: CudaCard | CpuCard) -> CudaHostCard | CpuHostCard:
    """The profile `card` of defaults.yml `cards:` (validated there), named."""
    typed = CudaHostCard if isinstance(card, CudaCard) else CpuHostCard
    return typed(**dict(card), name=name)
