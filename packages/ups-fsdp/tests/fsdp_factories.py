"""What :mod:`test_fsdp_fsdp`'s configs name by file path: a ``blocks`` callable."""

from __future__ import annotations

from torch import nn


def last_layer(model: nn.Module) -> list[nn.Module]:
    """The last child of ``model`` (a ``nn.Sequential``): the one block sharded alone."""
    return [list(model.children())[-1]]
