"""`qualify`'s library: probe -> plan -> start the bundled service -> accept -> report.

phases.py runs the phases around a "run" object: ``LocalRun`` (local.py, this machine) or ``HostRun``
(host.py, a host over SSH). Both probe, serve the model, hand the acceptance suite its target and clean
up; the phases around them are the same code. progress.py prints one line per acceptance case, and
reports.py scrubs secrets from a report and writes it (accept and qualify share both)."""
