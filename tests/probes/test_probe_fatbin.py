"""Reading a CUDA library's architectures from the file, and what they can run on."""

from __future__ import annotations

import json
import os
import struct

import pytest

from probes import fatbin
from tests.conftest import FIXTURES


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def _container(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf_with_section(name: bytes, data: bytes) -> bytes:
    """A minimal ELF64 file: null section, the data section, and the section-name table."""
    shstr = b"\0" + name + b"\0.shstrtab\0"
    data_off = 64
    shstr_off = data_off + len(data)
    shoff = (shstr_off + len(shstr) + 7) // 8 * 8
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)
    def sh(name_off, off, size):
        return struct.pack("<IIQQQQIIQQ", name_off, 1, 0, 0, off, size, 0, 0, 1, 0)
    body = bytes(header) + data + shstr
    body += b"\0" * (shoff - len(body))
    return body + sh(0, 0, 0) + sh(1, data_off, len(data)) + sh(1 + len(name) + 1, shstr_off, len(shstr))


def test_archs_read_from_nv_fatbin_section(tmp_path):
    containers = _container([_entry(2, 70, b"\x01" * 40), _entry(2, 80, b"\x02" * 24)]) + b"\0" * 8 + \
        _container([_entry(1, 90, b"ptx text" * 3), _entry(2, 90, b"\x03" * 16)])
    lib = tmp_path / "libfake.so"
    lib.write_bytes(_elf_with_section(b".nv_fatbin", containers))
    assert fatbin.archs_in(lib) == ["sm_70", "sm_80", "compute_90", "sm_90"]


def test_file_without_device_code_has_no_archs(tmp_path):
    lib = tmp_path / "libplain.so"
    lib.write_bytes(_elf_with_section(b".text", b"\x90" * 64))
    assert fatbin.archs_in(lib) == []


def test_recorded_h200_nccl_cannot_run_on_a_v100():
    """The lent H200's NCCL 2.28.9 (pip, CUDA 13) starts at sm_75: a V100 (7.0) would need another build."""
    report = json.loads((FIXTURES / "probes" / "h200-probe-quick.json").read_text())
    archs = report["host"]["nccl_archs"]
    assert fatbin.covers(archs, "9.0") == (True, "machine code sm_90")
    ok, why = fatbin.covers(archs, "7.0")
    assert not ok and "no sm_70 machine code" in why
    # The same archs came out of cuobjdump on that machine.
    for lib in report["host"]["nccl_libraries"]:
        assert lib["archs"] == lib["archs_cuobjdump"]


@pytest.mark.parametrize("archs, cc, ok, how", [
    (["sm_70"], "7.0", True, "machine code sm_70"),
    (["sm_70"], "7.5", True, "machine code sm_70"),  # same major, higher minor: the cubin runs
    (["sm_75"], "7.0", False, None),  # a higher minor's cubin does not run on a lower one
    (["sm_70"], "8.0", False, None),
    (["sm_80"], "8.6", True, "machine code sm_80"),
    (["sm_80", "compute_80"], "9.0", True, "PTX compute_80 (compiled by the driver at first use)"),
    (["sm_75", "compute_120"], "7.0", False, None),
])
def test_covers_rules(archs, cc, ok, how):
    got_ok, got_how = fatbin.covers(archs, cc)
    assert got_ok is ok
    if how:
        assert got_how == how


def test_the_fatbin_is_read_once_and_cached_by_the_files_hash(tmp_path, monkeypatch):
    from probes import fatbin_cache

    monkeypatch.setenv("V100PLAN_CACHE_DIR", str(tmp_path / "cache"))
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(_elf_with_section(b".nv_fatbin", _container([_entry(2, 90, b"\x03" * 16)])))
    reads = []

    def counted(path):
        reads.append(path)
        return fatbin.archs_in(path)

    assert fatbin_cache.archs_in(lib, read=counted) == (["sm_90"], "read")
    assert fatbin_cache.archs_in(lib, read=counted) == (["sm_90"], "cached")
    copy = tmp_path / "copy.so"  # the same bytes elsewhere: same hash, no second read
    copy.write_bytes(lib.read_bytes())
    assert fatbin_cache.archs_in(copy, read=counted) == (["sm_90"], "cached")
    assert len(reads) == 1
    before = lib.stat().st_mtime_ns
    lib.write_bytes(_elf_with_section(b".nv_fatbin", _container([_entry(2, 70, b"\x01" * 16)])))
    os.utime(lib, ns=(before + 10**9, before + 10**9))  # a rewrite within one clock tick keeps the old mtime
    assert fatbin_cache.archs_in(lib, read=counted) == (["sm_70"], "read")  # a new file: read again
    assert (fatbin_cache.cache_path().stat().st_mode & 0o777) == 0o600
