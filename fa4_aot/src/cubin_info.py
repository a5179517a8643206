"""What a cubin says about its kernels: registers, stack frame, parameter offsets.

Read from the ELF's ``.nv.info`` sections (EIATTR records), the same facts ptxas -v prints
and the driver reports through cuFuncGetAttribute / cuFuncGetParamInfo. Used by the build
(the manifest records registers and local memory) and by CPU tests (the parameter plan is
checked against the cubin as well as the PTX). Needs pyelftools; the runtime does not.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field

EIFMT_SVAL, EIFMT_HVAL, EIFMT_BVAL, EIFMT_NVAL = 4, 3, 2, 1
EIATTR_REGCOUNT = 0x2F
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_KPARAM_INFO = 0x17


@dataclass
class KernelInfo:
    registers: int = -1
    frame_bytes: int = 0
    stack_bytes: int = 0
    params: list[tuple[int, int, int]] = field(default_factory=list)  # (ordinal, offset, size)
    static_smem_bytes: int = 0


def _records(data: bytes):
    i = 0
    while i + 2 <= len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == EIFMT_SVAL:
            (n,) = struct.unpack_from("<H", data, i + 2)
            yield attr, data[i + 4 : i + 4 + n]
            i += 4 + n
        elif fmt == EIFMT_HVAL:
            yield attr, data[i + 2 : i + 4]
            i += 4
        elif fmt == EIFMT_BVAL:
            yield attr, data[i + 2 : i + 3]
            i += 3
        elif fmt == EIFMT_NVAL:
            yield attr, b""
            i += 2
        elif fmt == 0:  # padding to the section's alignment
            return
        else:
            raise ValueError(f"unknown EIATTR format {fmt:#x}")


def kernel_info(cubin: bytes, symbol: str) -> KernelInfo:
    from elftools.elf.elffile import ELFFile

    elf = ELFFile(io.BytesIO(cubin))
    symtab = elf.get_section_by_name(".symtab")
    index = next(i for i, s in enumerate(symtab.iter_symbols()) if s.name == symbol)
    info = KernelInfo()
    for attr, val in _records(elf.get_section_by_name(".nv.info").data()):
        if len(val) == 8:
            sym, value = struct.unpack("<II", val)
            if sym != index:
                continue
            if attr == EIATTR_REGCOUNT:
                info.registers = value
            elif attr == EIATTR_FRAME_SIZE:
                info.frame_bytes = value
            elif attr == EIATTR_MIN_STACK_SIZE:
                info.stack_bytes = value
    section = elf.get_section_by_name(f".nv.info.{symbol}")
    for attr, val in _records(section.data()):
        if attr == EIATTR_KPARAM_INFO:
            _, ordinal, offset, flags = struct.unpack("<IHHI", val)
            info.params.append((ordinal, offset, (flags >> 18) & 0x3FFF))
    info.params.sort()
    smem = elf.get_section_by_name(f".nv.shared.{symbol}")
    info.static_smem_bytes = smem["sh_size"] if smem is not None else 0
    return info
