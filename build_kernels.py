#!/usr/bin/env python3
"""Compile the variant matrix to cubins and write manifest.json. Needs no GPU.

    python build_kernels.py                     # every variant of fa4_aot.variants.MATRIX
    python build_kernels.py --only 'fwd.*.d128*' --jobs 2
    python build_kernels.py --out /tmp/kernels  # elsewhere (tests); default: the package

A variant is recompiled only when its build key changed: any fa4_aot module the compiler
imports (``kernel_sources``), the toolchain, or the variant itself. The manifest lists exactly the variants of this build;
cubins of other variants in the output folder are removed.
"""

from __future__ import annotations

import ast
import concurrent.futures as futures
import contextlib
import datetime
import hashlib
import json
import os
import shutil
import sys
import time
import traceback
from importlib.metadata import version
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from fa4_aot.launch import manifest as mf  # noqa: E402
from fa4_aot.variants import ARCHS, AXES, NOT_BUILT_REASONS, Variant, select  # noqa: E402

PACKAGE = ROOT / "fa4_aot"
COMPILER = PACKAGE / "src" / "compile.py"  # what a worker imports to compile a variant
# The DSL's cu13 libraries carry ptxas 13.x; cubins from it load on CUDA 13.0 drivers
# (seen on 580.159.04) and are not promised to load on older ones.
DRIVER_FLOOR = {"cuda_version": 13000, "driver": "580", "why": "cubins from ptxas 13.x (cu13 DSL libraries)"}


def kernel_sources(start: Path = COMPILER) -> list[Path]:
    """Every fa4_aot module the compiler imports, directly or through others, wherever the
    import statement is (a function's too), with the packages' __init__ on the way: the
    files a cubin and its manifest row are made from. Read from the source, not by
    importing it (no DSL needed). The top package's __init__ is left out: it is the run
    time's public face, which importing fa4_aot.src runs but no compile reads."""
    top = (PACKAGE / "__init__.py").resolve()
    seen, todo = {top}, [start.resolve()]
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        package = path.parent
        while package != PACKAGE.parent and (package / "__init__.py").exists():
            todo.append((package / "__init__.py").resolve())
            package = package.parent
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for module in _imported(node, path):
                if module[0] == "fa4_aot":
                    target = PACKAGE.parent.joinpath(*module)
                    todo += [target.with_suffix(".py"), target / "__init__.py"]
    return sorted(seen - {top})


def _imported(node, path: Path) -> list[tuple[str, ...]]:
    """The dotted modules (as tuples) an import statement names, relative ones resolved
    from ``path``; for ``from x import y`` both x and x.y (y may be a module)."""
    if isinstance(node, ast.Import):
        return [tuple(alias.name.split(".")) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        base = parts[:len(parts) - node.level] + tuple((node.module or "").split(".") if node.module else ())
    else:
        base = tuple(node.module.split("."))
    return [base] + [base + (alias.name,) for alias in node.names]


def build_key(variant: Variant, sources: list[Path] | None = None) -> str:
    """What a variant's cubin and row are made from: the compiler's modules
    (``kernel_sources``), the DSL's version and the variant."""
    h = hashlib.sha256()
    for path in sources if sources is not None else kernel_sources():
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    h.update(version("nvidia-cutlass-dsl").encode())
    h.update(json.dumps(variant.to_dict(), sort_keys=True).encode())
    return h.hexdigest()


def _use_arch(gpu_arch: str) -> None:
    """A worker's initializer: the DSL reads its target from CUTE_DSL_ARCH when first
    imported, so each worker pool serves one architecture (and compiles pass it too)."""
    os.environ["CUTE_DSL_ARCH"] = gpu_arch


def _compile_one(variant: Variant) -> tuple[Variant, dict, float]:
    if os.environ.get("CUTE_DSL_ARCH") != variant.gpu_arch:
        raise BuildError(f"{variant.name}: a worker for {os.environ.get('CUTE_DSL_ARCH')} was handed it")
    from fa4_aot.src.compile import compile_variant

    start = time.perf_counter()
    try:
        result = compile_variant(variant)
    except Exception as exc:
        # The DSL's errors do not survive the trip back from a worker process (they do not
        # unpickle), and the pool then waits forever: send the traceback as text instead.
        raise BuildError(f"{variant.name}: {type(exc).__name__}\n{traceback.format_exc()}") from None
    return variant, result, time.perf_counter() - start


class BuildError(RuntimeError):
    """A variant failed to compile; the message carries the worker's traceback."""


def _row(variant: Variant, result: dict, key: str, cubin_dir: Path) -> dict:
    cubin = result.pop("cubin")
    result.pop("ptx")
    path = cubin_dir / variant.cubin_file
    path.write_bytes(cubin)
    return {
        "name": variant.name,
        "variant": variant.to_dict(),
        "file": f"cubins/{variant.cubin_file}",
        "sha256": hashlib.sha256(cubin).hexdigest(),
        "size": len(cubin),
        "arch": variant.gpu_arch,
        "compute_capability": list(variant.compute_capability),
        "build_key": key,
        **result,
    }


@click.command()
@click.option("--only", multiple=True, help="Glob over variant names; repeatable.")
@click.option("--arch", "archs", multiple=True, type=click.Choice(ARCHS), help="Architectures; repeatable.")
@click.option("--jobs", "-j", default=os.cpu_count() or 1, show_default=True, help="Parallel compiles.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder (cubins/ and manifest.json). Default: the fa4_aot package.")
@click.option("--force", is_flag=True, help="Recompile even when the build key is unchanged.")
@click.option("--base", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="A built folder whose other variants (rows and cubins) complete this build's, so "
                   "--out holds a whole library: an A/B build of a few variants for the benchmarks.")
def main(only, archs, jobs, out, force, base):
    """Build cubins for the selected variants and write their manifest."""
    out = out or PACKAGE
    if base is not None and base.resolve() == out.resolve():
        raise click.UsageError("--base must be another folder than --out")
    cubin_dir = out / "cubins"
    cubin_dir.mkdir(parents=True, exist_ok=True)
    (ROOT / "build" / "ptx").mkdir(parents=True, exist_ok=True)
    wanted = select(tuple(only), tuple(archs))
    for arch in archs:
        if arch not in AXES["arch"]["built"]:
            click.echo(f"note: nothing is built for {arch}: {NOT_BUILT_REASONS['arch=' + arch]}")
    if not wanted:
        raise click.UsageError("no variant matches; see `fa4-aot list --all`")

    previous, old_toolchain = {}, None
    if (out / "manifest.json").exists():
        try:
            old = json.loads((out / "manifest.json").read_text())
            previous = {r["name"]: r for r in old["kernels"]}
            old_toolchain = old["toolchain"]
        except (ValueError, KeyError):
            previous = {}
    rows, todo = {}, []
    sources = kernel_sources()
    for v in wanted:
        key = build_key(v, sources)
        old = previous.get(v.name)
        path = cubin_dir / v.cubin_file
        if (not force and old and old.get("build_key") == key and path.exists()
                and hashlib.sha256(path.read_bytes()).hexdigest() == old["sha256"]):
            rows[v.name] = old
        else:
            todo.append((v, key))

    start = time.perf_counter()
    toolchain = None
    if todo:
        keys = dict((v.name, k) for v, k in todo)
        with _progress(len(todo), len(wanted)) as done:
            for arch in sorted({v.gpu_arch for v, _ in todo}):
                batch = [v for v, _ in todo if v.gpu_arch == arch]
                with futures.ProcessPoolExecutor(max_workers=max(1, jobs), initializer=_use_arch,
                                                 initargs=(arch,)) as pool:
                    for variant, result, seconds in pool.map(_compile_one, batch):
                        (ROOT / "build" / "ptx" / f"{variant.name}.ptx").write_text(result["ptx"])
                        toolchain = toolchain or _toolchain(result["ptx"])
                        rows[variant.name] = _row(variant, result, keys[variant.name], cubin_dir)
                        done(variant, seconds)
    names = [v.name for v in wanted]
    if base is not None:
        for row in json.loads((base / "manifest.json").read_text())["kernels"]:
            if row["name"] not in rows:
                shutil.copyfile(base / row["file"], out / row["file"])
                rows[row["name"]] = row
                names.append(row["name"])
        names.sort(key=Variant.from_name)
    keep = {Path(rows[n]["file"]).name for n in names}
    for stale in cubin_dir.glob("*.cubin"):
        if stale.name not in keep:
            stale.unlink()

    head = {
        "schema": mf.SCHEMA,
        "package_version": version_of_package(),
        "toolchain": toolchain or old_toolchain,
        "driver_floor": DRIVER_FLOOR,
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "axes": {k: {"declared": list(s["declared"]), "built": list(s["built"])} for k, s in AXES.items()},
        "not_built": NOT_BUILT_REASONS,
    }
    kernels = [rows[n] for n in names]
    text = mf.dumps(head, kernels)  # the rows last, with the index the run time reads them by
    (out / "manifest.json").write_text(text)
    if out == PACKAGE:
        (ROOT / "manifest.json").write_text(text)
    total = sum(r["size"] for r in kernels)
    click.echo(
        f"{len(wanted)} variants ({len(todo)} compiled, {len(wanted) - len(todo)} unchanged)"
        + (f" and {len(names) - len(wanted)} from {base}" if base is not None else "") + ", "
        f"{total / 1e6:.2f} MB of cubins, {time.perf_counter() - start:.1f} s -> {out / 'manifest.json'}"
    )


@contextlib.contextmanager
def _progress(todo: int, wanted: int):
    """Yields done(variant, seconds): a progress bar on a terminal, else (a log) one line each."""
    label = f"compiling {todo} of {wanted} variants"
    if sys.stderr.isatty():
        with click.progressbar(length=todo, label=label, file=sys.stderr) as bar:
            yield lambda variant, seconds: bar.update(1)
        return
    click.echo(label)
    count = iter(range(1, todo + 1))
    yield lambda variant, seconds: click.echo(f"[{next(count)}/{todo}] {variant.name} {seconds:.1f} s")


def _toolchain(ptx: str) -> dict:
    from fa4_aot.src.compile import ptxas_release

    libs = "cu13" if _has("nvidia-cutlass-dsl-libs-cu13") else "cu12"
    return {
        "dsl": f"nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}",
        "dsl_libs": libs,
        "ptxas": ptxas_release(ptx),
        "python": sys.version.split()[0],
    }


def _has(dist: str) -> bool:
    try:
        version(dist)
        return True
    except Exception:
        return False


def version_of_package() -> str:
    from fa4_aot import __version__

    return __version__


if __name__ == "__main__":
    main()
