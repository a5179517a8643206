"""setmaxnreg's budget (fa4_aot/src/common/registers.py): a config whose roles want more
registers than the launch gives the CTA hangs its kernel with no error, so it is refused
when the config is made, and at build time against the registers ptxas gave."""

import dataclasses

import pytest

from fa4_aot.src.common.registers import check_roles, launch_registers
from fa4_aot.src.sm90.bwd.config import BwdConfig
from fa4_aot.src.sm90.decode.config import DecodeConfig
from fa4_aot.src.sm90.fwd.config import FwdConfig
from fa4_aot.variants import MATRIX, Variant

CONFIGS = {"fwd": FwdConfig, "bwd": BwdConfig, "decode": DecodeConfig}
SETMAXNREG = [v for v in MATRIX if v.arch == "sm90a" and v.kind in CONFIGS]


def test_launch_registers():
    assert [launch_registers(t) for t in (384, 512, 640)] == [168, 128, 96]  # the manifest's, as built
    assert launch_registers(256) == 248  # 255 a thread at most, in multiples of 8
    assert launch_registers(256, ctas_per_sm=2) == 128
    assert launch_registers(160, ctas_per_sm=4) == 96


@pytest.mark.parametrize("variant", SETMAXNREG, ids=lambda v: v.name)
def test_every_config_fits_its_launch(variant):
    cfg = CONFIGS[variant.kind].of(variant)
    roles = cfg.register_roles
    if roles:
        assert sum(t for t, _ in roles) == cfg.threads
        assert sum(t * r for t, r in roles) <= cfg.threads * launch_registers(cfg.threads, getattr(cfg, "ctas_per_sm", 1))


def test_four_consumer_warpgroups_at_120_are_refused():
    """The first build of the four-warpgroup local forward: 640 threads get 96 registers a
    thread; the producer's decrease to 24 frees 9,216, the consumers' increase to 120 asks
    12,288, and they waited forever."""
    cfg = FwdConfig.of(Variant(kind="fwd", arch="sm90a", dtype="bf16", head_dim=64, causal=False, local=True))
    assert (cfg.threads, cfg.consumer_regs) == (640, 112)
    with pytest.raises(ValueError, match="wait forever"):
        dataclasses.replace(cfg, consumer_regs=120)


def test_the_build_checks_the_registers_ptxas_gave():
    """ptxas can give fewer registers than the launch allows (the plain decode kernel: 232
    of 248), so the build checks the roles again against the kernel's own count."""
    roles = [(128, 40), (128, 232)]
    check_roles("decode", roles, 256, 232)
    with pytest.raises(ValueError, match="wait forever"):
        check_roles("decode", roles, 256, 128)


@pytest.mark.parametrize("roles, threads, why", [
    ([(128, 24), (256, 244)], 384, "multiples of 8"),
    ([(128, 16), (256, 240)], 384, "multiples of 8"),
    ([(128, 24), (128, 240)], 384, "not the CTA's"),
])
def test_malformed_roles_are_refused(roles, threads, why):
    with pytest.raises(ValueError, match=why):
        check_roles("x", roles, threads, 168)
