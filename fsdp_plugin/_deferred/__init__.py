"""Deferred initialization: record a model's construction without memory, replay it unit by unit.

Four modules, one job each: ``ops`` (what each aten op does), ``graph`` (the recorded graph and its
registry), ``record`` (the recording mode and ``deferred_init``), ``replay`` (``materialize``, ``release``).
"""
from .record import deferred_init
from .replay import is_deferred, materialize, release

__all__ = ["deferred_init", "is_deferred", "materialize", "release"]
