"""fa4-aot: list the built kernels, verify them, and describe the build."""

from __future__ import annotations

import fnmatch
import json
import sys

import click

from .errors import Fa4AotError
from .manifest import PACKAGE_DIR, Manifest
from .variants import AXES, MATRIX, NOT_BUILT_REASONS


def _manifest(folder) -> Manifest:
    try:
        return Manifest(folder or PACKAGE_DIR)
    except Fa4AotError as e:
        raise click.ClickException(str(e)) from e


@click.group()
@click.option("--kernels", "folder", type=click.Path(file_okay=False), default=None,
              help="Folder holding manifest.json and cubins/ (default: the installed package).")
@click.pass_context
def main(ctx, folder):
    """FlashAttention kernels compiled ahead of time."""
    ctx.obj = folder


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
    for r in rows:
        main = max(r["launches"], key=lambda launch: launch["smem_bytes"])
        click.echo(f"{r['name']:<36} {r['size'] / 1024:7.1f} KiB  {len(r['launches'])} kernel(s)  "
                   f"smem {main['smem_bytes'] // 1024:3d} KiB  regs {main.get('registers', '?')}  "
                   f"local {max(x.get('local_bytes', 0) for x in r['launches'])} B")
    if show_all:
        built = {r["name"] for r in m.data["kernels"]}
        for v in MATRIX:
            if v.name not in built:
                click.echo(f"{v.name:<36} not in this build")
        click.echo("\nAxes (declared -> built):")
        for axis, spec in AXES.items():
            click.echo(f"  {axis:<14} {list(spec['declared'])} -> {list(spec['built'])}")
        for key, why in NOT_BUILT_REASONS.items():
            click.echo(f"  not built: {key}: {why}")
    click.echo(f"{len(rows)} of {len(m.rows)} built variants")


@main.command()
@click.pass_obj
def verify(folder):
    """Check every cubin's checksum, then whether this machine can run them."""
    m = _manifest(folder)
    bad = 0
    for row in m.data["kernels"]:
        try:
            m.cubin(row)
        except Fa4AotError as e:
            bad += 1
            click.echo(f"FAIL {row['name']}: {e}")
    click.echo(f"checksums: {len(m.rows) - bad} ok, {bad} bad")
    from .driver import compute_capability, device_count, device_name, init

    try:
        version = init()
        count = device_count()
    except Fa4AotError as e:
        click.echo(f"GPU: none usable ({e})")
        sys.exit(1 if bad else 0)
    floor = m.driver_floor
    click.echo(f"driver: CUDA {version // 1000}.{version % 1000 // 10} "
               f"({'ok' if version >= floor else f'too old, need {floor // 1000}.{floor % 1000 // 10}'})")
    archs = {tuple(r["compute_capability"]) for r in m.data["kernels"]}
    for dev in range(count):
        cc = compute_capability(dev)
        runs = "can run" if cc in archs else "cannot run"
        click.echo(f"device {dev}: {device_name(dev)}, sm_{cc[0]}{cc[1]}: {runs} these cubins")
    sys.exit(1 if bad or version < floor else 0)


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
