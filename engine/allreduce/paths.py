"""The allreduce path names, in one stdlib-only place: the flags (serve, rank, generate), the
supervisor (which must not import torch), the start-up choice and the metrics all use this list.

In the order the start-up choice prefers them when timings cannot be trusted."""

PATH_NAMES = ("device_mailbox_graph", "device_mailbox", "nccl", "host_mailbox", "gloo")
# What a user may ask for: a path by name, or "auto" (self-test and timing race).
ALLREDUCE_CHOICES = ("auto", *PATH_NAMES)
