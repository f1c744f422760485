"""The run configuration, for config users and for plugins with options of their own: one YAML
file read into frozen attrs classes (``Config``), the builder that names the key path of any
mistake (``structure``, with the validators ``at_least`` and ``above``), the errors of bad input
(``UsageError``, ``ConfigError`` and their message helpers), and the checks of a Python API's
arguments (``check_type``, ``choice``, ``boolean``, ``integer``, ``number``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._arguments import (
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
    from ._config import Config, config_from_mapping, load_config, read_config, read_yaml
    from ._errors import ConfigError, UsageError, did_you_mean, one_line, one_of
    from ._structure import above, at_least, structure

_EXPORTS = {
    "Config": "._config",
    "config_from_mapping": "._config",
    "load_config": "._config",
    "read_config": "._config",
    "read_yaml": "._config",
    "above": "._structure",
    "at_least": "._structure",
    "structure": "._structure",
    "ConfigError": "._errors",
    "UsageError": "._errors",
    "did_you_mean": "._errors",
    "one_line": "._errors",
    "one_of": "._errors",
    "ArgumentTypeError": "._arguments",
    "ArgumentValueError": "._arguments",
    "boolean": "._arguments",
    "check_type": "._arguments",
    "choice": "._arguments",
    "integer": "._arguments",
    "number": "._arguments",
    "saved_rank_state": "._arguments",
    "shown": "._arguments",
    "wrong_type": "._arguments",
    "wrong_value": "._arguments",
}
"""Each public name and the module that defines it."""

__all__ = [
    "above",
    "ArgumentTypeError",
    "ArgumentValueError",
    "at_least",
    "boolean",
    "check_type",
    "choice",
    "Config",
    "config_from_mapping",
    "ConfigError",
    "did_you_mean",
    "integer",
    "load_config",
    "number",
    "one_line",
    "one_of",
    "read_config",
    "read_yaml",
    "saved_rank_state",
    "shown",
    "structure",
    "UsageError",
    "wrong_type",
    "wrong_value",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
