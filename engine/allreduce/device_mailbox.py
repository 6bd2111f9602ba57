"""The device-memory mailbox over CUDA IPC: each rank writes its half straight into the peer's inbox.

Each rank allocates an inbox on its own GPU, zeroed, and shares a CUDA IPC handle
through the control store. A message is written as 8-byte words (4 data bytes,
4 step bytes), so every word carries its own step: the reader polls until all words
of the message carry the step it expects, with no separate flag to order against
the data. The step packs a per-start epoch (from the generation) above a counter,
so after a restart nothing left in memory can match; message k uses slot k % 2 (see
host_mailbox for why two slots suffice). Waits are bounded by the timeout and an
abort flag.

IPC handles come from cupy (cudaIpcGetMemHandle on a cudaMalloc'd base pointer,
as verified on the lent H200) when cupy is installed, else from torch's own CUDA
tensor sharing.
"""

from __future__ import annotations

import pickle
import time

import torch

from engine.allreduce.base import Path, PathError, PathTimeout


def _epoch(generation: int) -> int:
    return ((generation * 7919) % 2047) + 1  # 11 bits, never 0


class _Buffer:
    """A zeroed int32 [2, words, 2] buffer on ``device`` and a picklable handle the peer can open."""

    def __init__(self, words: int, device: torch.device):
        self.shape = (2, words, 2)
        nbytes = 2 * words * 2 * 4
        try:
            import cupy as cp
        except ImportError:
            cp = None
        with torch.cuda.device(device):
            if cp is not None:
                with cp.cuda.Device(device.index):
                    self._mem = cp.cuda.runtime.malloc(nbytes)
                    cp.cuda.runtime.memset(self._mem, 0, nbytes)
                    handle = cp.cuda.runtime.ipcGetMemHandle(self._mem)
                    arr = cp.ndarray(self.shape, cp.int32, cp.cuda.MemoryPointer(
                        cp.cuda.UnownedMemory(self._mem, nbytes, None, device.index), 0))
                    self.tensor = torch.as_tensor(arr, device=device)
                self.handle = ("cupy", handle, nbytes, self.shape)
            else:
                from torch.multiprocessing.reductions import reduce_tensor

                self.tensor = torch.zeros(self.shape, dtype=torch.int32, device=device)
                self.handle = ("torch", reduce_tensor(self.tensor))
        torch.cuda.synchronize(device)

    @staticmethod
    def open(handle, device: torch.device) -> torch.Tensor:
        if handle[0] == "cupy":
            import cupy as cp

            _, h, nbytes, shape = handle
            with cp.cuda.Device(device.index):
                ptr = cp.cuda.runtime.ipcOpenMemHandle(h)
                arr = cp.ndarray(shape, cp.int32, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, nbytes, None), 0))
                return torch.as_tensor(arr, device=device)
        fn, args = handle[1]
        return fn(*args)


def exchange_inboxes(inbox: _Buffer, key: str, rank: int, device: torch.device, store, barrier) -> torch.Tensor:
    """Publish this rank's inbox handle under ``key + rank``, wait for the peer's, and open it.

    The peer's inbox is where this rank writes; any IPC failure makes the path unusable here.
    """
    store.set(key + str(rank), pickle.dumps(inbox.handle))
    barrier()
    try:
        return _Buffer.open(pickle.loads(store.get(key + str(1 - rank))), device)
    except Exception as e:  # noqa: BLE001 - any IPC failure means this path is unusable here
        raise PathError(f"cannot open the peer's CUDA IPC buffer: {type(e).__name__}: {e}") from None


class DeviceMailbox(Path):
    name = "device_mailbox"

    def __init__(self, rank, timeout_s, abort=None, *, device: torch.device, store, generation: int,
                 barrier, max_bytes: int = 2 << 20):
        super().__init__(rank, timeout_s, abort)
        if device.type != "cuda":
            raise PathError("not applicable: the device mailbox needs CUDA devices")
        self.device = device
        self.words = max_bytes // 4
        self.inbox = _Buffer(self.words, device)
        self.peer_inbox = exchange_inboxes(self.inbox, f"device_mailbox/g{generation}/r", rank, device, store, barrier)
        self.staging = torch.zeros((self.words, 2), dtype=torch.int32, device=device)
        self.epoch = _epoch(generation)
        self.counter = 0

    def all_gather(self, x):
        raw = x.detach().contiguous().view(-1).view(torch.uint8)  # [nbytes]
        n = raw.numel()
        if n > self.words * 4:
            raise PathError(f"message of {n} bytes exceeds the device mailbox's {self.words * 4}")
        pad = (-n) % 4
        if pad:
            raw = torch.cat((raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)))
        words = raw.view(torch.int32)  # [w]
        w = words.numel()
        self.counter += 1
        step = (self.epoch << 20) | (self.counter & 0xFFFFF)
        slot = self.counter % 2
        self.staging[:w, 0] = words
        self.staging[:w, 1] = step
        self.peer_inbox[slot, :w].copy_(self.staging[:w])
        self._wait(slot, w, step)
        got = self.inbox.tensor[slot, :w, 0].clone().view(torch.uint8)[:n]
        peer = got.view(x.dtype).view(x.shape)
        mine = x.detach()
        return (mine, peer) if self.rank == 0 else (peer, mine)

    def _wait(self, slot: int, w: int, step: int) -> None:
        steps = self.inbox.tensor[slot, :w, 1]
        deadline = time.monotonic() + self.timeout_s
        polls = 0
        while not bool((steps == step).all()):
            polls += 1
            if self.abort.is_set():
                raise PathError("device mailbox wait aborted")
            if time.monotonic() > deadline:
                raise PathTimeout(f"device_mailbox: peer did not deliver message {self.counter} within "
                                  f"{self.timeout_s} s (peer stalled or gone)")
            if polls > 1000:
                time.sleep(0.0001)
