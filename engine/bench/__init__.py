"""Benchmarks that time the service's own code: the decode step (TP1), two GPUs (TP2), kernels,
and the served speed against the bench in one run.
"""
