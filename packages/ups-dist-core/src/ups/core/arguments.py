"""The former home of the checks of a Python API's arguments, kept so that ``from
ups.core.arguments import ...`` (a public module before the sub-packages) goes on working:
they are :mod:`ups.core.config`'s."""

from .config import (
    ArgumentTypeError,
    ArgumentValueError,
    boolean,
    check_type,
    choice,
    integer,
    number,
    saved_rank_state,
    shown,
    wrong_type,
    wrong_value,
)

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "boolean",
    "check_type",
    "choice",
    "integer",
    "number",
    "saved_rank_state",
    "shown",
    "wrong_type",
    "wrong_value",
]
