"""Allreduce / gather paths between the two ranks, one interface.

Every path implements ``all_gather(x) -> (rank 0's x, rank 1's x)`` as bit-exact
copies; the sum is then formed by both ranks in the same fixed order
(rank 0's half + rank 1's half), so both hold bit-identical activations whatever
the transport. Path names are shared with the plan, the flags and the metrics:
``nccl``, ``gloo``, ``host_mailbox``, ``device_mailbox``, ``device_mailbox_graph`` (PATH_NAMES).
"""
