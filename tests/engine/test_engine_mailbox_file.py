"""The host mailbox's file in /dev/shm: created 0600 whatever the umask, zero-filled (no step matches a
fresh file), and replaced by rename, never truncated, so a peer that still maps the old file keeps its bytes."""

from __future__ import annotations

import mmap
import os
import stat

from engine.allreduce import host_mailbox


def test_mailbox_file_is_private_zeroed_and_replaced_by_rename(tmp_path):
    path = str(tmp_path / "mbox")
    old_umask = os.umask(0)  # the most permissive umask must still give 0600
    try:
        host_mailbox._create(path, 4096)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path, "rb") as f:
        assert f.read() == bytes(4096)
    # A peer maps the file and writes into it; a restart then creates the file again.
    fd = os.open(path, os.O_RDWR)
    peer = mmap.mmap(fd, 4096)
    os.close(fd)
    peer[:4] = b"live"
    inode = os.stat(path).st_ino
    host_mailbox._create(path, 4096)
    assert os.stat(path).st_ino != inode          # a new file took the name
    assert peer[:4] == b"live"                    # the old mapping was not truncated under the peer
    with open(path, "rb") as f:
        assert f.read(4) == bytes(4)
    peer.close()
