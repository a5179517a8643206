"""fa4-aot: list the built kernels, verify them, and describe the build.

    fa4-aot list [--all] [PATTERN...]     # or: python -m fa4_aot list
    fa4-aot verify [--checksums-only]     # exit 0 only if the cubins are intact (and can run here)
    fa4-aot info
"""

from __future__ import annotations

import fnmatch
import json
import sys

import click

from . import __version__
from .errors import Fa4AotError
from .launch.manifest import PACKAGE_DIR, Manifest
from .variants import AXES, AXIS_NOTES, KINDS, MATRIX, NOT_BUILT_REASONS


def _manifest(folder) -> Manifest:
    try:
        return Manifest(folder or PACKAGE_DIR)
    except Fa4AotError as e:
        raise click.ClickException(str(e)) from e


@click.group()
@click.version_option(__version__, prog_name="fa4-aot")
@click.option("--kernels", "folder", type=click.Path(file_okay=False), default=None,
              help="Folder holding manifest.json and cubins/ (default: the installed package).")
@click.pass_context
def main(ctx, folder):
    """FlashAttention kernels compiled ahead of time."""
    ctx.obj = folder


# list's columns; smem and regs are those of the variant's launch with the most shared memory
COLUMNS = ("variant", "size KiB", "kernels", "smem KiB", "regs", "local B")
WIDTHS = (-44, 8, 7, 8, 4, 7)  # negative: left-aligned (the longest name: bwd.sm90a.fp16.d256.varlen.det.local.softcap)


def _line(cells) -> str:
    return "  ".join(f"{c!s:<{-w}}" if w < 0 else f"{c!s:>{w}}" for c, w in zip(cells, WIDTHS)).rstrip()


@main.command("list")
@click.argument("patterns", nargs=-1)
@click.option("--all", "show_all", is_flag=True, help="Also list matrix variants that are not built.")
@click.option("--json", "as_json", is_flag=True, help="Rows as JSON.")
@click.pass_obj
def list_(folder, patterns, show_all, as_json):
    """Built variants, filtered by glob PATTERNS (e.g. 'fwd.*.d128*')."""
    m = _manifest(folder)
    rows = [r for r in m.data["kernels"] if not patterns or any(fnmatch.fnmatchcase(r["name"], p) for p in patterns)]
    if as_json:
        click.echo(json.dumps([{k: r[k] for k in ("name", "sha256", "size", "launches")} for r in rows], indent=1))
        return
    click.echo(_line(COLUMNS))
    for r in rows:
        main = max(r["launches"], key=lambda launch: launch["smem_bytes"])
        click.echo(_line((r["name"], f"{r['size'] / 1024:.1f}", len(r["launches"]), main["smem_bytes"] // 1024,
                          main.get("registers", "?"), max(x.get("local_bytes", 0) for x in r["launches"]))))
    if show_all:
        built = {r["name"] for r in m.data["kernels"]}
        for v in MATRIX:
            if v.name not in built:
                click.echo(f"{v.name:<40} not in this build")
        click.echo("\nKinds:")
        for kind, what in KINDS.items():
            click.echo(f"  {kind:<14} {what}")
        click.echo("\nAxes (declared -> built):")
        for axis, spec in AXES.items():
            click.echo(f"  {axis:<14} {list(spec['declared'])} -> {list(spec['built'])}")
            if axis in AXIS_NOTES:
                click.echo(f"  {'':<14} {AXIS_NOTES[axis]}")
        for key, why in NOT_BUILT_REASONS.items():
            click.echo(f"  not built: {key}: {why}")
    click.echo(f"{len(rows)} of {len(m.rows)} built variants")


@main.command()
@click.option("--checksums-only", is_flag=True,
              help="Only check the cubins' sha256 against the manifest (no driver or GPU needed).")
@click.pass_obj
def verify(folder, checksums_only):
    """Check every cubin's checksum, then whether this machine can run them.

    Exits non-zero when a checksum fails, or (without --checksums-only) when no GPU here
    can run these cubins: no driver, a driver older than the manifest's floor, or no
    device of a built architecture.
    """
    m = _manifest(folder)
    bad = 0
    for row in m.data["kernels"]:
        try:
            m.cubin(row)
        except Fa4AotError as e:
            bad += 1
            click.echo(f"FAIL {row['name']}: {e}")
    click.echo(f"checksums: {len(m.rows) - bad} ok, {bad} bad")
    if checksums_only:
        sys.exit(1 if bad else 0)
    runs = _can_run_here(m)
    sys.exit(1 if bad or not runs else 0)


def _can_run_here(m: Manifest) -> bool:
    """Print the driver and each device; True when some device can run the cubins."""
    from .launch.driver import compute_capability, device_count, device_name, init

    try:
        version = init()
        count = device_count()
    except Fa4AotError as e:
        click.echo(f"GPU: none usable ({e}): these cubins cannot run here")
        return False
    floor = m.driver_floor
    new_enough = version >= floor
    click.echo(f"driver: CUDA {version // 1000}.{version % 1000 // 10} "
               f"({'ok' if new_enough else f'too old, need {floor // 1000}.{floor % 1000 // 10} (R580+)'})")
    archs = {tuple(r["compute_capability"]) for r in m.data["kernels"]}
    able = 0
    for dev in range(count):
        cc = compute_capability(dev)
        able += cc in archs
        click.echo(f"device {dev}: {device_name(dev)}, sm_{cc[0]}{cc[1]}: "
                   f"{'can run' if cc in archs else 'cannot run'} these cubins")
    if not count:
        click.echo("GPU: no CUDA device")
    built_for = ", ".join(sorted({r["arch"] for r in m.data["kernels"]}))
    if not able and count:
        click.echo(f"no device here is of an architecture these cubins are built for ({built_for})")
    return new_enough and able > 0


@main.command()
@click.pass_obj
def info(folder):
    """Toolchain, driver floor, sizes."""
    m = _manifest(folder)
    d = m.data
    total = sum(r["size"] for r in d["kernels"])
    click.echo(f"fa4_aot {d['package_version']}, built {d.get('built_at', '?')}")
    for k, v in d["toolchain"].items():
        click.echo(f"  {k}: {v}")
    floor = d["driver_floor"]
    click.echo(f"driver floor: CUDA {floor['cuda_version'] // 1000}.{floor['cuda_version'] % 1000 // 10} ({floor.get('why', '')})")
    click.echo(f"{len(d['kernels'])} cubins, {total / 1e6:.2f} MB, in {m.folder / 'cubins'}")
