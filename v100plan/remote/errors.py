"""Errors of remote work. All are environment problems (exit 4), each with its own wording.

A host-key problem (unknown or changed key) also exits 4: the host we reached is not one we
can trust yet, which the operator fixes outside v100plan (docs/deploy.md, "Host keys").
"""

from __future__ import annotations

from v100plan.errors import EnvironmentProblem


class HostKeyError(EnvironmentProblem):
    """The host's key is not in known_hosts (unknown) or differs from the recorded one (changed)."""


class Unreachable(EnvironmentProblem):
    """No SSH session could be opened: refused, timed out, name unknown, authentication failed."""


class RemoteTimeout(EnvironmentProblem):
    """A remote command ran past its timeout; it was stopped on the host."""


class RemoteFailed(EnvironmentProblem):
    """A remote command exited non-zero where that means v100plan cannot go on."""
