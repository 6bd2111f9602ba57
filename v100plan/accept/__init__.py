"""The acceptance suite: functional scenarios, injected faults and load against a running
OpenAI-compatible service, assembled into one AcceptanceReport document.

`run_acceptance(target, options)` is the one entry point; `v100plan accept` and
`v100plan qualify` call it. Scenarios follow the case protocol the probes use (key,
description, applicable -> reason to waive, run, timeout; passed / warned / failed /
waived / error). Nothing here imports the engine or torch at module load.
"""
