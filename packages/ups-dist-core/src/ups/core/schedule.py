"""The former home of the training schedule's records, kept so that ``from ups.core.schedule
import ...`` goes on working: they live in :mod:`ups.core.engine`."""

from .engine import Action, Rule, Schedule, Trigger

__all__ = ["Action", "Rule", "Schedule", "Trigger"]
