"""v100plan: the control plane (CLI, catalogue, planner, deploy, acceptance, reports).

Runs on the operator's machine and needs no GPU: it never imports torch, pynvml
or cupy at module level (ruff's TID253 enforces it).
"""

from profiles.document import TOOL_VERSION as __version__

__all__ = ["__version__"]
