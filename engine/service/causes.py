"""Why a rank generation ended, and the faults the acceptance suite may inject: one table each.

Stdlib only: the watchdog, the ranks, the proxy, the fault control and the acceptance suite
(v100plan/accept/faults.py) all read these, so a new cause or a new fault is one line here.
A failure carries its cause as a value; nothing classifies a failure by the words of its message.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Cause(str, Enum):
    """Why the watchdog ended a rank generation (the `cause` of the log's rank_failure, and the
    `cause` label of v100plan_rank_failures_total), or why a start failed (rank_start_failed)."""

    EXIT = "exit"                  # a rank exited, or closed its control socket, on its own
    SIGNAL = "signal"              # a rank was killed by a signal (its exit status says which)
    LOCKSTEP = "lockstep"          # the ranks' per-token check disagreed (LOCKSTEP FAILURE)
    LIVENESS = "liveness"          # a rank sent no heartbeat for the liveness timeout (frozen or gone)
    PEER_WAIT = "peer_wait"        # a live rank waited the liveness timeout for its peer in one allreduce
    STALL = "stall"                # no progress for the stall timeout busy, or no answer to a ping idle
    ALLREDUCE = "allreduce"        # a rank's allreduce failed or timed out (the rank says so and exits)
    SELFTEST = "selftest"          # start-up: no allreduce path passed its self-test
    STARTUP = "startup"            # start-up failed otherwise (weights, device, a rank not ready in time)
    CONTROL = "control"            # the proxy lost a rank's control socket while writing to it


@dataclass(frozen=True)
class Failure:
    """A failure with its cause and its text (the text is for people: logs and /health)."""

    cause: Cause
    reason: str
    rank: int | None = None        # the rank at fault, where one is

    def __str__(self) -> str:
        return self.reason


# A rank's exit status -> the cause it means (engine/service/rank.py's exit codes).
RANK_EXIT_CAUSES = {1: Cause.STARTUP, 3: Cause.LOCKSTEP, 4: Cause.ALLREDUCE}


def exit_cause(returncode: int | None) -> Cause:
    if returncode is not None and returncode < 0:
        return Cause.SIGNAL
    return RANK_EXIT_CAUSES.get(returncode or 0, Cause.EXIT)


@dataclass(frozen=True)
class Fault:
    """One action of the fault control (POST /control/inject {"action": ...})."""

    action: str
    kind: str                      # signal: sent to the rank's pid | hook: armed in the rank | proxy | starts
    needs_rank: bool
    what: str


FAULTS = (
    Fault("kill", "signal", True, "SIGKILL the rank"),
    Fault("freeze", "signal", True, "SIGSTOP the rank (the watchdog must find it silent)"),
    Fault("thaw", "signal", True, "SIGCONT the rank"),
    Fault("corrupt_hash", "hook", True, "flip one bit of the rank's lockstep hash at a decode step"),
    Fault("stall_allreduce", "hook", True, "the rank sleeps past its allreduce timeout before an exchange"),
    Fault("exit", "hook", True, "the rank exits (code 17) at a decode step"),
    Fault("kill_proxy", "proxy", False, "SIGKILL the proxy (its supervisor must start a new one)"),
    Fault("fail_starts", "starts", False, "the next `count` rank starts fail their allreduce self-test"),
)
ACTIONS = tuple(f.action for f in FAULTS)
RANK_HOOKS = tuple(f.action for f in FAULTS if f.kind == "hook")   # what the protocol's fault message carries
SIGNAL_ACTIONS = tuple(f.action for f in FAULTS if f.kind == "signal")


@dataclass(frozen=True)
class Scenario:
    """One fault scenario of the acceptance suite: the action, the rank it lands on, and every
    cause that is a correct detection of it (a frozen rank is found by its silent heartbeat, or by
    its peer waiting for it, or by the step watchdog; all three are right)."""

    key: str
    action: str
    rank: int | None
    detected_by: tuple[Cause, ...]
    description: str


_KILLED = (Cause.SIGNAL, Cause.EXIT, Cause.ALLREDUCE)  # the peer's allreduce may notice first
SCENARIOS = (
    Scenario("kill_rank1", "kill", 1, _KILLED,
             "SIGKILL rank 1 mid-stream: error to the client, both ranks restarted"),
    Scenario("kill_rank0", "kill", 0, _KILLED,
             "SIGKILL rank 0 mid-stream: error to the client, both ranks restarted"),
    Scenario("freeze_rank1", "freeze", 1, (Cause.LIVENESS, Cause.PEER_WAIT, Cause.STALL),
             "SIGSTOP rank 1 mid-stream until the watchdog acts: error, the frozen rank killed, restart"),
    Scenario("corrupt_hash", "corrupt_hash", 1, (Cause.LOCKSTEP,),
             "rank 1's lockstep hash corrupted: a LOCKSTEP FAILURE, no wrong token served, restart"),
    Scenario("stall_allreduce", "stall_allreduce", 1, (Cause.PEER_WAIT, Cause.LIVENESS, Cause.STALL, Cause.ALLREDUCE),
             "rank 1's allreduce stalls past its timeout: its waiting peer reports it, restart"),
)
