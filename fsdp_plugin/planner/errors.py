"""Errors of the planner."""
from ..errors import ConfigError


class PlanError(ConfigError):
    """The planner cannot build, capture or run the model as described; the message names the fix."""
