"""Which GPU architectures a CUDA library carries code for, read from the file itself.

A CUDA shared library (libnccl.so, libtorch_cuda.so) keeps its device code in the
ELF section ``.nv_fatbin``: a run of fat-binary containers (16-byte header, magic
0xBA55ED50), each holding entries of kind 1 (PTX, compiled by the driver at load)
or kind 2 (ELF cubin, machine code for one architecture). Entry header: kind u16
@0, header size u32 @4, payload size u64 @8, architecture u32 @28 (70 = sm_70).
By hand: ``cuobjdump --list-elf --list-ptx libnccl.so.2``.

Reads only headers through mmap, so a 300 MB library takes well under a second.
"""

from __future__ import annotations

import mmap
import re
import struct
from pathlib import Path

MAGICS = (0xBA55ED50, 0x466243B1)
KIND_PTX, KIND_ELF = 1, 2


def _sections(buf: mmap.mmap | bytes) -> dict[str, tuple[int, int]]:
    """ELF64 little-endian section name -> (file offset, size); empty if not such an ELF."""
    if buf[:4] != b"\x7fELF" or buf[4] != 2 or buf[5] != 1:
        return {}
    shoff = struct.unpack_from("<Q", buf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", buf, 0x3A)
    if not shoff or not shnum or shstrndx >= shnum:
        return {}
    headers = []
    for i in range(shnum):
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", buf, shoff + i * shentsize)
        headers.append((name, offset, size))
    str_off = headers[shstrndx][1]
    out = {}
    for name_off, offset, size in headers:
        end = buf.find(b"\0", str_off + name_off)
        out[bytes(buf[str_off + name_off:end]).decode(errors="replace")] = (offset, size)
    return out


def _walk(buf: mmap.mmap | bytes, start: int, end: int) -> set[tuple[int, int]]:
    """(kind, arch) of every entry in the containers between start and end."""
    found: set[tuple[int, int]] = set()
    pos = start
    magic_bytes = [struct.pack("<I", m) for m in MAGICS]
    while pos + 16 <= end:
        hits = [h for h in (buf.find(m, pos, end) for m in magic_bytes) if h >= 0]
        if not hits:
            break
        pos = min(hits)
        _magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", buf, pos)
        entry, stop = pos + header_size, min(pos + header_size + fat_size, end)
        while entry + 32 <= stop:
            kind, _v, ehead, payload = struct.unpack_from("<HHIQ", buf, entry)
            arch = struct.unpack_from("<I", buf, entry + 28)[0]
            if ehead < 32 or kind not in (KIND_PTX, KIND_ELF):
                break
            found.add((kind, arch))
            entry += ehead + payload
        pos = max(stop, pos + 16)
    return found


def archs_in(path: str | Path) -> list[str]:
    """Sorted ["compute_90", "sm_70", "sm_80", ...]: cubins as sm_XY, PTX as compute_XY."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        section = _sections(buf).get(".nv_fatbin")
        start, end = (section[0], section[0] + section[1]) if section else (0, len(buf))
        entries = _walk(buf, start, end)
    names = {("sm_" if kind == KIND_ELF else "compute_") + str(arch) for kind, arch in entries if arch}
    return sorted(names, key=lambda n: (int(re.sub(r"\D", "", n)), n))


def _cc_number(cc: str) -> tuple[int, int]:
    major, minor = cc.split(".")
    return int(major), int(minor)


def covers(archs: list[str], compute_capability: str) -> tuple[bool, str]:
    """Can code from ``archs`` run on a card of ``compute_capability``, and how.

    A cubin runs on its own major version at the same or a higher minor (sm_70 on 7.0 and 7.2);
    PTX of an architecture at or below the card's is compiled by the driver at load.
    """
    major, minor = _cc_number(compute_capability)
    cubins = [a for a in archs if a.startswith("sm_")]
    for a in cubins:
        num = int(re.sub(r"\D", "", a))
        if num // 10 == major and num % 10 <= minor and not a.endswith("a"):
            return True, f"machine code {a}"
    ptx = [int(re.sub(r"\D", "", a)) for a in archs if a.startswith("compute_")]
    ok_ptx = [p for p in ptx if p <= major * 10 + minor]
    if ok_ptx:
        return True, f"PTX compute_{max(ok_ptx)} (compiled by the driver at first use)"
    return False, f"no sm_{major}{minor} machine code and no PTX at or below compute_{major}{minor} in {archs}"
