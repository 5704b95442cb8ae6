"""Planner: predict a sharded job's memory per rank, wire bytes and step time before it starts.

    plan = fp.plan(build_model, world_size=[1, 2, 4], auto_wrap_policy={Block}, optimizer="adamw",
                   inputs=lambda: (torch.randint(0, V, (4, 128)),))
    print(plan); plan.peak_bytes[2]
"""
from ._result import Plan, WorldPlan
from ._time import HARDWARE, Calibration, calibrate
from ._layer_sizes import LayerSizes
from ._fit import Fit, fit, parse_bytes
from .api import plan
from ._recommend import CANDIDATES, QUANTIZED_CANDIDATES, recommend
from .errors import PlanError

__all__ = ["plan", "Plan", "WorldPlan", "fit", "Fit", "parse_bytes", "Calibration", "calibrate", "LayerSizes",
           "HARDWARE", "PlanError", "recommend", "CANDIDATES", "QUANTIZED_CANDIDATES"]
