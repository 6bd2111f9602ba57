"""One rank process: ``python -m engine rank ...`` (protocol in engine/service/protocol.py, docs/engine.md).

Start-up: listen on the control socket, meet the peer (gloo over a FileStore in the
rendezvous directory), choose and self-test the allreduce path, load this rank's
weights, then send ``ready`` (or ``fatal`` and exit non-zero). Requests are taken
strictly in the order the client sends them, one at a time; the same client
(the proxy) feeds both ranks the same sequence, so admission is decided in one place.

Once ready, a thread of its own sends a heartbeat every --heartbeat-interval-s (with the
step counter and how long this rank has been waiting for its peer in an allreduce), so
the proxy finds a frozen rank, or a rank whose peer stalled, in seconds, busy or idle.

A request that fails for any reason of its own (an input the model cannot take, a
sampler error, any exception outside the allreduce and the lockstep check) is answered
with an ``error`` message for that request and the rank stays up; only a fault of the
rank itself (LOCKSTEP FAILURE, a failed or timed-out allreduce) ends the process.

Exit codes: 0 client closed the connection, 1 start-up failed, 3 LOCKSTEP FAILURE,
4 allreduce failed or timed out, 17 exit injected by the fault hook.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
import time

from engine import dtype_rule
from engine.core import speculative
from engine.service import protocol
from engine.service.causes import RANK_HOOKS, Cause
from engine.service.serve_config import concurrency_problem

EXIT_STARTUP, EXIT_LOCKSTEP, EXIT_ALLREDUCE, EXIT_INJECTED = 1, 3, 4, 17
class StartFailed(Exception):
    """Start-up failed for a reason with a cause of its own (the allreduce self-test)."""

    def __init__(self, cause: Cause, message: str):
        super().__init__(message)
        self.cause = cause


def log(rank: int, msg: str) -> None:
    sys.stderr.write(f"[rank {rank}] {msg}\n")
    sys.stderr.flush()


class Server:
    """The control socket: one client, JSON lines; a reader thread answers ping at once and queues the rest."""

    def __init__(self, path: str):
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is created 0600
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        self.sock.listen(1)
        self.conn: protocol.LineSocket | None = None
        self.connected = threading.Event()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        c, _ = self.sock.accept()
        self.conn = protocol.LineSocket(c)
        self.connected.set()

    def send(self, msg: dict) -> None:
        if not self.connected.wait(timeout=30):
            return  # nobody to tell; stderr has it
        with self.lock:
            try:
                self.conn.send(msg)
            except OSError:
                pass


class Rank:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.r = args.rank
        self.counter = 0
        self.busy = False
        self.requests: queue.Queue = queue.Queue()
        self.cancelled: set[str] = set()
        self.cancel_log: list[str] = []  # --max-concurrency > 1: cancels received, not yet taken (rank_batch)
        self.faults: list[dict] = []
        self.abort = threading.Event()
        self.wait_since: float | None = None  # monotonic start of the current allreduce wait

    # ---- start-up ---------------------------------------------------------------------------------
    def start(self) -> dict:
        import torch

        from engine.allreduce.base import PathError
        from engine.allreduce.comm import Comm
        from engine.core import config, weights
        from engine.core.lockstep import Lockstep
        from engine.core.model import Model

        a = self.args
        why = None if a.max_concurrency == "memory" else concurrency_problem(a.max_concurrency)
        if why:
            raise ValueError(why)
        marks = [("begin", time.monotonic())]  # the start-up phases' times go to the ready log line
        if a.fail_selftest and not a.enable_fault_injection:
            raise ValueError("--fail-selftest needs --enable-fault-injection")
        device = torch.device(a.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"--device {a.device}: CUDA is not available here")
            torch.cuda.set_device(device)
            major, minor = torch.cuda.get_device_capability(device)
            a.dtype = dtype_rule.resolve(a.dtype, (major, minor))
            # bf16 needs bf16 tensor cores (compute capability 8.0+); emulation is not a fact we plan on.
            if a.dtype == "bfloat16" and major < 8:
                raise ValueError(f"bfloat16 on compute capability {major}.{minor} has no tensor-core support; "
                                 f"use --dtype float16")
        a.dtype = dtype_rule.resolve(a.dtype, dtype_rule.CPU) if device.type == "cpu" else a.dtype
        dtype = getattr(torch, a.dtype)
        if device.type == "cpu":
            # Two ranks on one host share its cores: each taking all of them only makes them fight.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.world))
        cfg = config.load(a.model)
        self.read_bw = self._read_bw(device)
        marks.append(("read_bw", time.monotonic()))
        self.path, self.choice = None, None
        if a.world == 2:
            from engine.allreduce import select
            from engine.allreduce.dist import init_control
            from engine.core import tp

            tp.check_divisible(cfg, 2)
            os.makedirs(a.rendezvous, exist_ok=True)
            store = init_control(a.rendezvous, a.generation, self.r, 2, a.allreduce_timeout_s)
            marks.append(("rendezvous", time.monotonic()))
            try:
                self.choice = select.choose(
                    a.allreduce, rank=self.r, device=device, dtype=dtype, timeout_s=a.allreduce_timeout_s,
                    abort=self.abort, rendezvous_dir=a.rendezvous, generation=a.generation, store=store,
                    fail_selftest=set(a.fail_selftest), log=lambda m: log(self.r, m))
            except PathError as e:
                raise StartFailed(Cause.SELFTEST, str(e)) from None
            self.path = self.choice.path
            if self.path.name not in ("gloo", "nccl"):  # nothing needs the gloo group (its TCP port) any more
                from engine.allreduce.dist import close_control

                close_control()
            self._time_waits(self.path)
            marks.append(("allreduce_choice", time.monotonic()))
        self.comm = Comm(self.path) if self.path else None
        self.model = Model(cfg, world=a.world, rank=self.r, dtype=dtype, device=device, comm=self.comm,
                           kv_dtype=a.kv_cache_dtype)
        weights.load_into(self.model, a.model)
        self.spec_tokens = speculative.draft_tokens(a)
        if self.spec_tokens:
            from engine.core import mtp

            mtp.check_draft_tokens(self.model, self.spec_tokens)  # at start, not at the first request
        from engine.vision.load import load_vision

        self.vision = None if a.no_vision else load_vision(self.model, a.model)  # replicated on both ranks
        # The context is chosen once what the rank holds is on the card (weights, vision tower), then the slots.
        self.context = self._context(cfg, device, dtype)
        a.max_context = self.context["max_context"]
        self.concurrency = self._concurrency(cfg, device, dtype)
        a.max_concurrency = self.concurrency["max_concurrency"]
        self.model.setup_cache(a.max_context, slots=a.max_concurrency)
        marks.append(("weights", time.monotonic()))
        from engine.core import runner  # the decode step's graphs are captured now, not at the first request
        # with --max-concurrency above 1 the speculative rounds run per slot, eagerly
        # (engine/service/rank_batch_spec.py): no graphs of slot 0's rounds to capture
        decoder = runner.prepare(self.model, prefix_cache_bytes=0 if a.no_prefix_cache else None,
                                 spec_tokens=self.spec_tokens if a.max_concurrency == 1 else 0)
        if self.spec_tokens and a.max_concurrency > 1:
            decoder.info["speculation"] = {"draft_tokens": self.spec_tokens, "mode": "eager", "graphs": 0,
                                           "capture_s": None, "why": "per-slot rounds (--max-concurrency above 1)"}
        decoder.info["prefix_cache"] = "off" if a.no_prefix_cache else "on"  # /health says it (every stats too)
        self.batch_graphs = None
        if a.max_concurrency > 1:  # the batched step's graphs per (row bucket, window), before ready
            from engine.service import batch_graphs

            self.batch_graphs, decoder.info["batch_graphs"] = batch_graphs.for_rank(
                self.model, decoder, a.max_concurrency, enabled=a.batch_graphs)
        from engine.vision import config as vconfig
        from engine.vision import serve as vserve

        decoder.info.update(vserve.health(self.vision, vconfig.load(a.model) is not None))
        marks.append(("decode_prep", time.monotonic()))
        # One unseen request now, so the first real one after a (re)start does not pay the prefill path's
        # one-time costs (docs/service.md, "Start-up"): the ranks run it together, before `ready`.
        decoder.info["warm_up_s"] = round(profiled(lambda: runner.warm_up(self.model, self.prefill_chunk(),
                                                                         self.spec_tokens), self.r), 2)
        log(self.r, runner.describe(decoder.info) + f"; read bandwidth {self.read_bw['read_bw_gbps']} GB/s "
                    f"({self.read_bw['read_bw_source']})")
        self.lockstep = Lockstep(self.path, device, self.r) if self.path else None
        name = self.path.name if self.path else "none"
        selftest = "passed" if self.path else "not_applicable"
        race = self.choice.race if self.choice else None
        marks.append(("warm_up", time.monotonic()))
        phases = ", ".join(f"{n} {t - p:.2f} s" for (_, p), (n, t) in zip(marks, marks[1:]))
        held = self.model.weights_info()
        log(self.r, f"context {a.max_context} (bound {self.context['bound']}: {self.context['why']})")
        log(self.r, f"max_concurrency {a.max_concurrency} (bound {self.concurrency['bound']}: "
                    f"{self.concurrency['why']})")
        log(self.r, f"ready: allreduce {name}, dtype {a.dtype}, device {a.device}, max_context {a.max_context}, "
                    f"weights {held['format']} {held['bytes'] / 1e9:.3f} GB, vision {decoder.info['vision']} "
                    f"(start-up {phases})")
        return protocol.ready(self.r, os.getpid(), a.generation, name, selftest, race, a.max_context, cfg.vocab_size,
                              decode={**decoder.info, **self.read_bw, "weight_bytes": self.model.weight_bytes(),
                                      "device": str(device)},
                              choice={"why": self.choice.why, "selftest": self.choice.selftest} if self.choice else None,
                              context=self.context, concurrency=self.concurrency)

    def _card(self, device):
        """This rank's card for the memory defaults (None on CPU): its share of the card, what the rank holds now."""
        import torch

        from engine.service import context_default

        if device.type != "cuda":
            return None
        props = torch.cuda.get_device_properties(device)
        return context_default.Card(capacity_bytes=props.total_memory * self.args.card_share,
                                    held_bytes=torch.cuda.memory_allocated(device), name=props.name)

    def _context(self, cfg, device, dtype) -> dict:
        """--max-context, else the native context bounded by this rank's card (engine/service/context_default.py),
        for --max-concurrency N sequences when N is given."""
        from engine.service import context_default

        a = self.args
        return context_default.choose(a.max_context, cfg, world=a.world, dtype_bytes=dtype.itemsize,
                                      kv_int8=a.kv_cache_dtype == "int8", card=self._card(device),
                                      sequences=1 if a.max_concurrency == "memory" else a.max_concurrency)

    def _concurrency(self, cfg, device, dtype) -> dict:
        """--max-concurrency N, else (memory) the sequences of the chosen context that fit this rank's card, the
        smaller of the two ranks' figures (engine/service/concurrency_default.py)."""
        import torch

        from engine.service import concurrency_default

        a = self.args
        if a.max_concurrency != "memory":
            return concurrency_default.record(a.max_concurrency, "flag", f"--max-concurrency {a.max_concurrency}")
        mine = concurrency_default.from_memory(a.max_context, cfg, world=a.world, dtype_bytes=dtype.itemsize,
                                               kv_int8=a.kv_cache_dtype == "int8", card=self._card(device))
        if self.path is None:
            return mine
        # Both ranks hold the same slots (their schedules are one): the smaller figure, if their cards differ.
        both = [int(t.to("cpu").item()) for t in
                self.path.all_gather(torch.tensor([mine["max_concurrency"]], dtype=torch.int64, device=device))]
        if min(both) < mine["max_concurrency"]:
            peer = 1 - self.r
            return {**mine, "max_concurrency": min(both),
                    "why": f"{min(both)} at once, what rank {peer}'s card fits (this rank's: {mine['why']})"}
        return mine

    def _read_bw(self, device) -> dict:
        """The card's read bandwidth for the achieved fraction: the flag's, else measured now (a sum over
        a buffer far beyond the caches: 1 GiB on a GPU, before the weights take the memory; 32 MiB on a CPU)."""
        if self.args.read_bw_gbps:
            return {"read_bw_gbps": round(float(self.args.read_bw_gbps), 1),
                    "read_bw_source": self.args.read_bw_source}
        from engine.core import timing

        nbytes = (1 << 30) if device.type == "cuda" else (32 << 20)
        gbps = timing.read_bandwidth_gbps(device, nbytes, iters=10 if device.type == "cuda" else 3)
        return {"read_bw_gbps": round(gbps, 1), "read_bw_source": "measured"}

    def constraint_for(self, spec):
        """A request's grammar constraint (engine.core.grammar), or None."""
        if not spec:
            return None
        from engine.core import grammar

        return grammar.Constraint(grammar.compiler_for(self.args.model), spec)

    def log_line(self, msg: str) -> None:
        log(self.r, msg)

    def prefill_chunk(self) -> int:
        if self.args.prefill_chunk:
            return self.args.prefill_chunk
        return 2048 if self.model.device.type == "cuda" else 256

    def decode_stats(self) -> dict:
        """Decoder.stats against this card's read bandwidth, with where that figure came from; on a GPU the card's
        memory in use (the acceptance report holds it against the plan's memory per GPU)."""
        return {**self.model.decoder.stats(self.read_bw["read_bw_gbps"]), **self.read_bw, **self._memory()}

    def _memory(self) -> dict:
        """{"memory": card memory in use (cudaMemGetInfo: total - free, every process on the card), its total, this
        rank's share of the card, torch's peak reserved bytes}; {} on CPU."""
        device = self.model.device
        if device.type != "cuda":
            return {}
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return {"memory": {"card_used_bytes": total - free, "card_total_bytes": total,
                           "card_share": self.args.card_share,
                           "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}}

    def _time_waits(self, path) -> None:
        """Record when this rank enters and leaves each exchange with its peer (the heartbeat
        reports the wait). Instance attribute: Comm, Lockstep and the path's own allreduce_sum
        and gather_last all go through path.all_gather."""
        inner = path.all_gather

        def all_gather(x):
            self.wait_since = time.monotonic()
            try:
                return inner(x)
            finally:
                self.wait_since = None

        path.all_gather = all_gather

    def heartbeat(self, server: Server, interval_s: float) -> None:
        while True:
            since = self.wait_since
            server.send(protocol.heartbeat(self.counter, self.busy,
                                           0.0 if since is None else time.monotonic() - since))
            time.sleep(interval_s)

    # ---- the control socket -------------------------------------------------------------------------
    def reader(self, server: Server) -> None:
        server.connected.wait()
        while True:
            try:
                msg = server.conn.recv()
            except protocol.ProtocolError as e:
                if "closed" in str(e):
                    log(self.r, "client closed the connection; exiting")
                    os._exit(0)
                server.send(protocol.error(None, str(e)))
                continue
            t = msg["type"]
            if t == "ping":
                server.send(protocol.pong(self.counter, self.busy))
            elif t == "cancel":
                if self.args.max_concurrency > 1:
                    self.cancel_log.append(msg["id"])  # the batch loop takes them in order (rank_batch)
                else:
                    self.cancelled.add(msg["id"])
            elif t == "generate":
                self.requests.put(msg)
            elif t == "fault":
                if not self.args.enable_fault_injection:
                    server.send(protocol.error(None, "fault injection is disabled (start with --enable-fault-injection)"))
                    continue
                if msg["what"] not in RANK_HOOKS:
                    server.send(protocol.error(None, f"fault must be one of {', '.join(RANK_HOOKS)}"))
                    continue
                self.faults.append({"what": msg["what"], "at_step": msg.get("at_step")})
                server.send(protocol.fault_armed(msg["what"], msg.get("at_step")))
            else:
                server.send(protocol.error(msg.get("id"), f"a rank does not accept {t!r} messages"))

    def step_faults(self, k: int) -> bool:
        """The fault hooks armed for batch step ``k`` (rank_batch): exit, stall the allreduce; returns whether to
        corrupt this step's lockstep hash."""
        if self._fault("exit", k):
            log(self.r, f"fault injection: exiting at step {k}")
            os._exit(EXIT_INJECTED)
        if self._fault("stall_allreduce", k):
            log(self.r, f"fault injection: stalling the allreduce at step {k}")
            self.comm.stall_s = self.args.allreduce_timeout_s * 2 + 5
        corrupt = self._fault("corrupt_hash", k)
        if corrupt:
            log(self.r, f"fault injection: corrupting this rank's hash at step {k}")
        return corrupt

    def _fault(self, what: str, k: int) -> bool:
        for f in self.faults:
            if f["what"] == what and (f["at_step"] is None or f["at_step"] == k):
                self.faults.remove(f)
                return True
        return False

    # ---- requests ------------------------------------------------------------------------------------
    def serve(self, server: Server) -> None:
        from engine.allreduce.base import PathError
        from engine.core import runner
        from engine.core.lockstep import LockstepFailure, Record, judge, token_hash
        from engine.core.logits_processors import Processing
        from engine.core.sampling import Sampler
        from engine.vision import serve as vserve

        while True:
            req = self.requests.get()
            rid = req["id"]
            self.busy = True
            try:
                sampler = Sampler(req.get("temperature", 0.0), req.get("top_p", 1.0), req.get("seed", 0),
                                  processing=Processing.from_message(req.get("sampling"), req["prompt_ids"]),
                                  constraint=self.constraint_for(req.get("grammar")))
            except (ValueError, TypeError, OverflowError) as e:
                self.busy = False
                server.send(protocol.error(rid, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
                continue
            seq = {"n": 0}

            def hook(phase: str, k: int, toks: list[int], pos: int) -> bool:
                self.counter += 1
                cancel = rid in self.cancelled
                if self.lockstep is not None:
                    if phase == "decode" and self._fault("exit", k):
                        log(self.r, f"fault injection: exiting at step {k}")
                        os._exit(EXIT_INJECTED)
                    if phase == "decode" and self._fault("stall_allreduce", k):
                        log(self.r, f"fault injection: stalling the allreduce at step {k}")
                        self.comm.stall_s = self.args.allreduce_timeout_s * 2 + 5
                    checked = self.model.decoder.checked if phase == "decode" else None
                    if checked is not None:  # this token was checked with the peer inside its step's graph
                        cancel = judge(checked, seq["n"], self.r)
                    else:
                        h = token_hash(toks, sampler.offset) ^ vserve.lockstep_hash(self.vision)
                        if phase == "decode" and self._fault("corrupt_hash", k):
                            log(self.r, f"fault injection: corrupting this rank's hash at step {k}")
                            h ^= 1
                        cancel = self.lockstep.exchange(Record(seq["n"], len(toks), h, pos, int(cancel)))
                seq["n"] += 1
                if cancel:
                    return True
                if phase == "prefill":
                    server.send(protocol.progress(rid, pos, self.counter))
                else:
                    server.send(protocol.token(rid, k, toks[0], self.counter, sampler.logprobs))
                return False

            def flags(k: int) -> tuple[int, int]:
                """(cancel, corrupt) for the step whose graph checks greedy token k with the peer."""
                corrupt = self.lockstep is not None and self._fault("corrupt_hash", k)
                if corrupt:
                    log(self.r, f"fault injection: corrupting this rank's hash at step {k} (inside the step's graph)")
                return int(rid in self.cancelled), int(corrupt)

            reply = None
            info: dict = {}
            try:
                ids, spec_tokens = vserve.begin(self.vision, req, self.spec_tokens)  # images: engine.vision
                out, reason = runner.run(self.model, ids, int(req["max_tokens"]), sampler,
                                         set(req.get("stop_token_ids") or []), self.prefill_chunk(), hook,
                                         flags=flags, info=info,
                                         # a request with penalties, a bias or a grammar is not speculated: its
                                         # drafts would be judged without them (docs/service.md)
                                         spec_tokens=spec_tokens if sampler.plain else 0)
            except (LockstepFailure, PathError):
                raise  # a fault of the rank pair, not of the request: the proxy restarts both
            except Exception as e:  # noqa: BLE001 - any other failure belongs to this request alone
                # Both ranks see the same input, so both fail the same way at the same point
                # (before the same exchange); the pair stays in step and serves the next request.
                why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                log(self.r, f"request {rid} failed: {why}")
                reply = protocol.error(rid, why)
            else:
                # One line per request in each rank's log: the acceptance suite checks the two ranks
                # agree request by request (same steps, same finish, same token hash).
                log(self.r, f"request {rid} finish={reason} steps={seq['n']} tokens={len(out)} "
                            f"hash={token_hash(out, 0):016x}")
                stats = self.decode_stats()
                if "spec" in info:  # this request's drafted and accepted tokens
                    stats["spec"] = info["spec"]
                log(self.r, describe_stats(stats))
                reply = protocol.done(rid, reason, len(req["prompt_ids"]), len(out), decode=stats,
                                      cached_tokens=int(info.get("cached_tokens", 0)))
            finally:
                if self.vision is not None:
                    self.vision.end()
                self.cancelled.discard(rid)
                self.busy = False  # idle before the answer leaves: a ping after "done" finds the rank idle
            server.send(reply)


PROFILE_ENV = "V100PLAN_PROFILE_WARM_UP"


def profiled(fn, rank: int):
    """fn(); with $V100PLAN_PROFILE_WARM_UP=N set, its N largest host-time entries (cumulative) go to the log."""
    top = os.environ.get(PROFILE_ENV)
    if not top:
        return fn()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(int(top))
    log(rank, "warm-up profile:\n" + text.getvalue())
    return out


def describe_stats(s: dict) -> str:
    """One log line: what this rank's decode achieves (medians over its most recent tokens)."""
    def num(v, unit=""):
        return "n/a" if v is None else f"{v}{unit}"

    frac = s.get("read_bw_fraction")
    return (f"decode {s['mode']}/{s['kernels']}: step {num(s.get('step_ms'), ' ms')} (device), "
            f"token {num(s.get('token_ms'), ' ms')} (wall), {num(s.get('achieved_gbps'), ' GB/s')} = "
            f"{'n/a' if frac is None else f'{frac * 100:.1f} %'} of {s['read_bw_gbps']} GB/s "
            f"({s['read_bw_source']}), over {s.get('steps')} steps")


def main(args: argparse.Namespace) -> int:
    from engine.service.proctitle import set_title

    # `ps` tells rank 0 from rank 1 (a forked rank would show its fork server's command line).
    set_title(f"v100plan-engine rank {args.rank} generation {args.generation} {args.control_socket}",
              f"v100plan-rank{args.rank}")
    why = protocol.socket_path_ok(args.control_socket)
    if why:
        log(args.rank, why)
        return EXIT_STARTUP
    server = Server(args.control_socket)
    rank = Rank(args)
    try:
        ready = rank.start()
    except Exception as e:  # noqa: BLE001 - every start-up failure becomes one fatal message
        msg = f"start-up failed: {type(e).__name__}: {e}" if not isinstance(e, ValueError) else f"start-up failed: {e}"
        log(args.rank, msg)
        server.send(protocol.fatal(msg, getattr(e, "cause", Cause.STARTUP)))
        time.sleep(0.2)
        return EXIT_STARTUP
    server.send(ready)
    threading.Thread(target=rank.reader, args=(server,), daemon=True).start()
    if args.heartbeat_interval_s > 0:
        threading.Thread(target=rank.heartbeat, args=(server, args.heartbeat_interval_s), daemon=True).start()
    from engine.allreduce.base import PathError
    from engine.core.lockstep import LockstepFailure

    try:
        if args.max_concurrency > 1:
            from engine.service.rank_batch import BatchLoop

            BatchLoop(rank, server, args.max_concurrency).serve()
        else:
            rank.serve(server)
    except LockstepFailure as e:
        log(args.rank, str(e))
        server.send(protocol.fatal(str(e), Cause.LOCKSTEP))
        time.sleep(0.2)
        return EXIT_LOCKSTEP
    except PathError as e:
        msg = f"allreduce failed: {e}"
        log(args.rank, msg)
        server.send(protocol.fatal(msg, Cause.ALLREDUCE))
        time.sleep(0.2)
        return EXIT_ALLREDUCE
    return 0
