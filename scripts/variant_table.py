#!/usr/bin/env python3
"""Print the README's table of built variants, from a manifest.json.

    python scripts/variant_table.py                   # the package's build (fa4_aot/)
    python scripts/variant_table.py --kernels DIR     # another build folder
    python scripts/variant_table.py --update README.md   # rewrite the table between the markers
    python scripts/variant_table.py --check README.md    # exit 1 if README's table differs

One row per kind, architecture and head dim; its cubins are the dtypes times the forms
(the name's tail after the head dim: causal, det, q2). Reads JSON only: no GPU, no DSL.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- variant-table -->", "<!-- /variant-table -->"


def _span(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def table(manifest: dict) -> str:
    groups: dict[tuple, list[dict]] = {}
    for row in manifest["kernels"]:
        v = row["variant"]
        head_dims = f"d{v['head_dim']}" + (f"v{v['head_dim_v']}" if v.get("head_dim_v") else "")
        groups.setdefault((v["kind"], v["arch"], head_dims), []).append(row)
    lines = ["| variants | cubins | forms | launches per call | shared memory, KiB |", "|---|---|---|---|---|"]
    for (kind, arch, head_dims), rows in groups.items():
        dtypes = sorted({r["variant"]["dtype"] for r in rows})
        forms = []
        for r in rows:
            tail = r["name"].split(".", 4)[4:]
            form = f"`.{tail[0]}`" if tail else "plain"
            if form not in forms:
                forms.append(form)
        smem = [max(launch["smem_bytes"] for launch in r["launches"]) // 1024 for r in rows]
        lines.append(f"| `{kind}.{arch}.{{{','.join(dtypes)}}}.{head_dims}` | {len(rows)} | {', '.join(forms)} | "
                     f"{_span([len(r['launches']) for r in rows])} | {_span(smem)} |")
    toolchain = manifest["toolchain"]
    lines.append(f"\n{len(manifest['kernels'])} cubins, built with {toolchain['dsl']}, ptxas {toolchain['ptxas']}.")
    return "\n".join(lines)


def _replace(text: str, new_table: str) -> str:
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise click.ClickException(f"the markers {BEGIN} ... {END} are not both there")
    return f"{head}{BEGIN}\n{new_table}\n{END}{tail}"


@click.command()
@click.option("--kernels", "folder", type=click.Path(file_okay=False, path_type=Path), default=ROOT / "fa4_aot",
              show_default=True, help="Folder holding manifest.json.")
@click.option("--update", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="Write the table into this file, between the markers.")
@click.option("--check", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="Exit 1 if this file's table differs from the manifest's.")
def main(folder: Path, update: Path | None, check: Path | None):
    path = folder / "manifest.json"
    if not path.exists():
        raise click.ClickException(f"{path} does not exist: build the kernels first (python build_kernels.py)")
    text = table(json.loads(path.read_text()))
    if update is not None:
        update.write_text(_replace(update.read_text(), text))
    elif check is not None:
        if _replace(check.read_text(), text) != check.read_text():
            click.echo(f"{check}'s variant table differs from {path}; run: "
                       f"python scripts/variant_table.py --update {check}", err=True)
            sys.exit(1)
    else:
        click.echo(text)


if __name__ == "__main__":
    main()
