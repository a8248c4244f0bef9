"""What ptxas decided for each kernel of a CUBIN, read from the ELF itself (no cuobjdump, no GPU):
registers per thread (the high byte of the `.text.<kernel>` section's sh_info), static shared
memory (the size of `.nv.shared.<kernel>`, less what the system reserves) and local memory per thread (EIATTR_FRAME_SIZE in
`.nv.info`, where spills and local arrays live)."""
from __future__ import annotations

import struct

_EIFMT_SVAL = 0x04
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2f
SYSTEM_SHARED_BYTES = 1024


def _sections(blob: bytes):
    """[(name, sh_type, offset, size, info)] of an ELF64 little-endian image; ValueError otherwise."""
    if blob[:4] != b"\x7fELF" or len(blob) < 64 or blob[4] != 2 or blob[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF (a CUBIN)")
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3a)
    if shentsize < 64 or shoff + shnum * shentsize > len(blob) or shstrndx >= shnum:
        raise ValueError("a CUBIN whose section table does not fit the file")
    raw = []
    for i in range(shnum):
        name, typ, _, _, off, size, _, info = struct.unpack_from("<IIQQQQII", blob, shoff + i * shentsize)
        raw.append((name, typ, off, size, info))
    _, _, stroff, strsize, _ = raw[shstrndx]
    if stroff + strsize > len(blob):
        raise ValueError("a CUBIN whose section names do not fit the file")

    def name_at(i):
        end = blob.find(b"\0", stroff + i, stroff + strsize)
        return blob[stroff + i:end if end >= 0 else stroff + strsize].decode("ascii", "replace")
    return [(name_at(n), typ, off, size, info) for n, typ, off, size, info in raw]


def _symbols(blob: bytes, secs) -> list[str]:
    """Symbol names by index (.symtab with its .strtab)."""
    tab = next((s for s in secs if s[0] == ".symtab"), None)
    strtab = next((s for s in secs if s[0] == ".strtab"), None)
    if tab is None or strtab is None:
        return []
    out = []
    for i in range(tab[3] // 24):
        n, = struct.unpack_from("<I", blob, tab[2] + i * 24)
        end = blob.find(b"\0", strtab[2] + n, strtab[2] + strtab[3])
        out.append(blob[strtab[2] + n:end].decode("ascii", "replace") if end >= 0 else "")
    return out


def resources(blob: bytes) -> dict[str, dict[str, int]]:
    """{kernel: {"registers", "shared_bytes", "local_bytes"}} for every kernel of the CUBIN."""
    secs = _sections(blob)
    out = {}
    for name, _, _, _, info in secs:
        if name.startswith(".text."):
            out[name[6:]] = {"registers": info >> 24, "shared_bytes": 0, "local_bytes": 0}
    # sm_90's CUBINs reserve 1 KB of every block's shared memory for the system: a
    # .nv.shared.reserved.0 section marks it (of size 0), and each kernel's own section counts it
    reserved = SYSTEM_SHARED_BYTES if any(name.startswith(".nv.shared.reserved.") for name, *_ in secs) else 0
    for name, _, _, size, _ in secs:
        if name.startswith(".nv.shared.") and name[11:] in out:
            out[name[11:]]["shared_bytes"] = size - reserved if size >= reserved else size
    syms = _symbols(blob, secs)
    for name, _, off, size, _ in secs:
        if not name.startswith(".nv.info"):
            continue
        pos, end = off, off + size
        while pos + 4 <= end:
            fmt, attr, n = struct.unpack_from("<BBH", blob, pos)
            pos += 4
            if fmt != _EIFMT_SVAL:
                n = 0   # NVAL, BVAL, HVAL: the value (if any) is in the 2-byte field itself
            if fmt == _EIFMT_SVAL and n >= 8 and attr in (_EIATTR_FRAME_SIZE, _EIATTR_REGCOUNT):
                sym, value = struct.unpack_from("<II", blob, pos)
                kernel = syms[sym] if sym < len(syms) else ""
                if kernel in out:
                    out[kernel]["local_bytes" if attr == _EIATTR_FRAME_SIZE else "registers"] = value
            pos += n
    return out
