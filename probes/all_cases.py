"""Importing this module registers every probe case (each module registers its own)."""

from probes import bandwidth, inventory, p2p, stack, throttle  # noqa: F401
