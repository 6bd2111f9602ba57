"""The inbox-handle exchange both device mailboxes use: each rank publishes its own handle and opens the
peer's (never its own), and an IPC failure is a PathError naming the cause, so the path is not used."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from engine.allreduce import device_mailbox
from engine.allreduce.base import PathError


class _Store:
    def __init__(self):
        self.kv = {}

    def set(self, k, v):
        self.kv[k] = v

    def get(self, k):
        return self.kv[k]


def test_each_rank_opens_the_peers_handle(monkeypatch):
    monkeypatch.setattr(device_mailbox._Buffer, "open", staticmethod(lambda handle, device: ("opened", handle)))
    store = _Store()
    store.set("k/r1", pickle.dumps(("h", 1)))  # rank 1 published first
    got = device_mailbox.exchange_inboxes(SimpleNamespace(handle=("h", 0)), "k/r", 0, "dev", store, lambda: None)
    assert got == ("opened", ("h", 1))
    assert pickle.loads(store.kv["k/r0"]) == ("h", 0)


def test_an_ipc_failure_is_a_path_error(monkeypatch):
    def refuse(handle, device):
        raise RuntimeError("cudaErrorPeerAccessUnsupported")

    monkeypatch.setattr(device_mailbox._Buffer, "open", staticmethod(refuse))
    store = _Store()
    store.set("k/r0", pickle.dumps(("h", 0)))
    with pytest.raises(PathError, match="cannot open the peer's CUDA IPC buffer: RuntimeError"):
        device_mailbox.exchange_inboxes(SimpleNamespace(handle=("h", 1)), "k/r", 1, "dev", store, lambda: None)
