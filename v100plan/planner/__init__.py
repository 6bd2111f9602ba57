"""The planner: ``plan(hardware, model, engine, target) -> Plan``, a pure function.

No I/O, no clocks, no GPU: arithmetic over the profiles. Each module holds one
part of the whiteboard (memory, decode, prefill, allreduce, strategies) and each
function's docstring gives its formula and where its numbers come from.
"""

from v100plan.planner.inputs import (
    Engine,
    Hardware,
    Model,
    Target,
    engine_from_doc,
    hardware_from_doc,
    model_from_doc,
)
from v100plan.planner.plan import plan

__all__ = [
    "Engine", "Hardware", "Model", "Target", "engine_from_doc", "hardware_from_doc", "model_from_doc", "plan",
]
