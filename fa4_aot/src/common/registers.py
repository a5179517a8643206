"""setmaxnreg's budget: what the warp roles of a CTA take after setmaxnreg, against the
registers the launch gave the CTA. Pure Python (the configs and the build use it).

setmaxnreg moves registers between a CTA's warps within the CTA's allocation (its threads
times the kernel's registers a thread, fixed at launch). An increase waits until enough
are free, so roles that together want more than the allocation wait forever: the kernel
hangs, with no error (the four-warpgroup local forward at 120 a consumer thread did). The
configs check their roles against the most a launch can give (``launch_registers``); the
build checks them again against the registers ptxas gave the kernel, which can be fewer.
"""

from __future__ import annotations

REGISTER_FILE = 65536  # 32-bit registers per SM (sm_90)
MAX_PER_THREAD = 255
GRANULE = 8  # registers a thread are allocated, and setmaxnreg counts, in multiples of 8
SETMAXNREG_RANGE = (24, 256)


def launch_registers(threads: int, ctas_per_sm: int = 1) -> int:
    """The most registers a thread can have in a CTA of ``threads`` threads with
    ``ctas_per_sm`` CTAs resident on an SM."""
    return min(MAX_PER_THREAD, REGISTER_FILE // (threads * ctas_per_sm)) // GRANULE * GRANULE


def check_roles(name: str, roles: list[tuple[int, int]], threads: int, registers: int) -> None:
    """ValueError where ``roles`` ((threads, registers a thread after setmaxnreg) of each
    role; none: no setmaxnreg) cannot all hold their registers in a CTA of ``threads``
    threads launched with ``registers`` a thread, or a role's count is not one setmaxnreg
    takes."""
    if not roles:
        return
    if sum(t for t, _ in roles) != threads:
        raise ValueError(f"{name}: the roles' threads {roles} are not the CTA's {threads}")
    for _, regs in roles:
        if regs % GRANULE or not SETMAXNREG_RANGE[0] <= regs <= SETMAXNREG_RANGE[1]:
            raise ValueError(f"{name}: setmaxnreg takes multiples of {GRANULE} in {SETMAXNREG_RANGE}, not {regs}")
    want, have = sum(t * r for t, r in roles), threads * registers
    if want > have:
        raise ValueError(f"{name}: after setmaxnreg its roles {roles} (threads, registers) want {want} registers, "
                         f"but the CTA has {have} ({threads} threads at {registers}): the increase would wait "
                         "forever")
