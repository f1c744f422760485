"""The former name of the built-in plugin's module, kept so that ``from ups.core.builtins import
...`` goes on working: the plugin ``ups-dist-core`` is :mod:`ups.core.plugin`'s private
``_builtins``, and its public names are :mod:`ups.core.plugin`'s."""

from .plugin import TorchSamplerOptions, torch_sampler

__all__ = ["TorchSamplerOptions", "torch_sampler"]
