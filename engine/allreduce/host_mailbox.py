"""The host shared-memory mailbox: each rank writes its half into its own file in /dev/shm, the peer
reads it from there.

Layout of a rank's outbox file: two slots (message k uses slot k % 2), each
``[step u64 | nbytes u64 | data ... | step u64]``. The writer stores the data and
then the trailing step; the reader waits for the trailing step to equal the step
it expects, so it never takes stale data (a slot holds step k - 2 until rewritten)
and never a half-written message (x86 keeps stores and loads in program order).
Two slots suffice: a rank can only write k + 2 after it has read the peer's k + 1,
which the peer writes only after it has finished reading k.

The file is created 0600 under a temporary name, sized, and renamed into place:
never truncated while the peer maps it; once both ranks have mapped both files the
names are unlinked (the mappings stay), so nothing is left behind in /dev/shm. The files live in
a private directory of this start (0700, checked to be this user's after it is made), named by a
secret 128-bit key of this start (mailbox.key in the 0700 rendezvous directory, written by the
proxy or, when absent, by whichever rank comes first): a /dev/shm listing shows no file name
another user could pre-create, and nobody else can create anything inside. A restarted pair
starts from fresh zeroed files. Every wait is bounded by the timeout and an abort flag.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
import tempfile
import time

import numpy as np
import torch

from engine.allreduce.base import Path, PathError, PathTimeout

HDR = 16
TRAILER = 8


def _base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def private_dir(key: str) -> str:
    """This start's 0700 directory for its mailbox files, made by the first rank to look; refused
    (PathError) when what is there is not a directory of this user's that only it can enter."""
    path = os.path.join(_base(), f"v100plan-mbox-{key}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
        raise PathError(f"the mailbox directory {path} is not this user's private directory: not used")
    return path


KEY_FILE = "mailbox.key"  # engine/service/proxy_ranks.py MAILBOX_KEY_FILE


def mailbox_key(rendezvous_dir: str) -> str:
    """This start's secret key: read from the rendezvous directory, or created there (0600) by
    the first rank to look, published whole by a hard link so the other never reads half of it."""
    path = os.path.join(rendezvous_dir, KEY_FILE)
    try:
        with open(path) as fh:
            return fh.read().strip()
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(16))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # the peer was first: its key stands
    finally:
        os.unlink(tmp)
    with open(path) as fh:
        return fh.read().strip()


def mailbox_file(rendezvous_dir: str, generation: int, rank: int) -> str:
    # engine/service/proxy_ranks.py MAILBOX_GLOB matches the directory to clean up after killed ranks.
    key = mailbox_key(rendezvous_dir)
    return os.path.join(private_dir(key), f"v100plan-mbox-{key}-g{generation}-r{rank}")


def _create(path: str, size: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)  # a fresh file reads as zeros: no step matches
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _map(path: str, size: int) -> tuple[mmap.mmap, np.ndarray]:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)


class HostMailbox(Path):
    name = "host_mailbox"

    def __init__(self, rank, timeout_s, abort=None, *, rendezvous_dir: str, generation: int,
                 barrier, max_bytes: int = 8 << 20):
        super().__init__(rank, timeout_s, abort)
        self.max_bytes = max_bytes
        self.slot_bytes = HDR + max_bytes + TRAILER
        size = 2 * self.slot_bytes
        self.mine_path = mailbox_file(rendezvous_dir, generation, rank)
        self.peer_path = mailbox_file(rendezvous_dir, generation, 1 - rank)
        _create(self.mine_path, size)
        self._mine_mm, self.mine = _map(self.mine_path, size)
        # Both files are in place (a stale one from an earlier run replaced) before either rank maps its peer's.
        barrier()
        if not os.path.exists(self.peer_path):
            raise PathError(f"peer mailbox {self.peer_path} is missing after the start-up barrier")
        self._peer_mm, self.peer = _map(self.peer_path, size)
        # Both mappings exist now; the names are no longer needed, and unlinking them here means a rank
        # that dies later leaves nothing behind in /dev/shm.
        barrier()
        os.unlink(self.mine_path)
        try:
            os.rmdir(os.path.dirname(self.mine_path))  # the second rank to get here removes it
        except OSError:
            pass
        self.step = 0

    def _u64(self, buf: np.ndarray, off: int) -> np.ndarray:
        return buf[off:off + 8].view(np.uint64)

    def all_gather(self, x):
        data = x.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()  # [nbytes]
        n = data.shape[0]
        if n > self.max_bytes:
            raise PathError(f"message of {n} bytes exceeds the mailbox's {self.max_bytes}")
        self.step += 1
        base = (self.step % 2) * self.slot_bytes
        self._u64(self.mine, base)[0] = self.step
        self._u64(self.mine, base + 8)[0] = n
        self.mine[base + HDR:base + HDR + n] = data
        self._u64(self.mine, base + HDR + n)[0] = self.step  # published last
        self._wait(base + HDR + n, self.step)
        got = self.peer[base + HDR:base + HDR + n].copy()
        peer = torch.from_numpy(got).view(x.dtype).view(x.shape).to(x.device)
        mine = x.detach()
        return (mine, peer) if self.rank == 0 else (peer, mine)

    def _wait(self, off: int, step: int) -> None:
        cell = self._u64(self.peer, off)
        spins = 0
        deadline = None
        while cell[0] != step:
            spins += 1
            if spins < 200:
                continue
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            if self.abort.is_set():
                raise PathError("host mailbox wait aborted")
            if time.monotonic() > deadline:
                raise PathTimeout(f"host_mailbox: peer did not publish message {step} within "
                                  f"{self.timeout_s} s (peer stalled or gone)")
            # Two ranks may share two cores with everything else: give the CPU away while waiting.
            time.sleep(0 if spins < 2000 else 0.0001)

    def close(self) -> None:
        for name in ("mine", "peer"):
            setattr(self, name, None)
        for mm in (getattr(self, "_mine_mm", None), getattr(self, "_peer_mm", None)):
            try:
                if mm is not None:
                    mm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the process
