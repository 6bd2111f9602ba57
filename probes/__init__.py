"""Measurement code that runs on the GPU host: ``python -m probes`` prints a ProbeReport as JSON.

Standard library plus, lazily and only inside the cases that need them, nvidia-ml-py
(through probes/nvml.py alone), cupy and torch. Never imports typer, rich, fabric or
v100plan: the control plane runs this as a process and reads its JSON.
"""
