"""What every front door (dense, varlen, decode) does to launch: the default library, the
launch tensors of a call's arrays, the question whether a variant is built at all, the
repeat key of a raw call, the backward's rows of some axes.

Standard library and the launch layer only.
"""

from __future__ import annotations

import math
import threading

from . import checks
from .arrays import DeviceArray
from ..errors import UnsupportedVariantError
from .loader import KernelLibrary

LOG2E = math.log2(math.e)
_library = None
_library_lock = threading.Lock()


def default_library() -> KernelLibrary:
    """The kernels shipped in the package, loaded on first use."""
    global _library
    if _library is None:
        with _library_lock:
            if _library is None:
                _library = KernelLibrary()
    return _library


def set_default_library(library: KernelLibrary | None) -> None:
    """Launch every call that names no ``library`` (the adapters' too) from ``library``
    (another build's folder: an A/B of two builds, tests of a build elsewhere); None: the
    package's again, loaded on next use."""
    global _library
    with _library_lock:
        _library = library


def launch_tensors(arrays: dict) -> dict:
    """The launch's tensors by the kernels' input names (fa4_aot/src/interfaces.py: the
    public arguments' names), but the workspace, which the row's rule carves."""
    return {name: a.as_launch_tensor() for name, a in arrays.items() if name != "workspace"}


def check_built(manifest, axes: dict, q_tiles: int | None) -> None:
    """UnsupportedVariantError, naming the nearest built variants, unless ``axes`` (all but
    the arch) with ``q_tiles`` (None: any) are built for some architecture of this
    manifest: asked before the device, so a request no device could serve says so even
    where there is none."""
    archs = manifest.archs or ["sm90a"]
    tiles = (1, 2) if q_tiles is None else (q_tiles,)
    if not any(manifest.built(**axes, arch=arch, q_tiles=t) for arch in archs for t in tiles):
        manifest.find(**axes, arch=archs[0], q_tiles=tiles[0])  # raises


def served(manifest, kind: str, problem: checks.ForwardProblem) -> checks.ForwardProblem:
    """``problem`` with the head dim of the ``kind`` kernels that serve its tensors
    (Manifest.kernel_head_dim of the wider of q's and v's, a typed error where none does);
    the tensors' own stay its ``columns`` and ``columns_v``, which the kernels read and
    write."""
    return problem._replace(head_dim=manifest.kernel_head_dim(kind, max(problem.columns, problem.columns_v)))


def served_sizes(manifest, kind: str, sizes: dict) -> dict:
    """``served`` for a dict of sizes ("head_dim", "head_dim_v": the tensors'): the kernels'
    head dim as "head_dim", the tensors' as "columns" and "columns_v"."""
    d, dv = sizes["head_dim"], sizes["head_dim_v"]
    return {**sizes, "head_dim": manifest.kernel_head_dim(kind, max(d, dv)), "columns": d, "columns_v": dv}


def kernel_head_dim(manifest, kind: str, head_dim: int, head_dim_v: int | None) -> int:
    """The workspace functions' head dim: the kernels' for q's ``head_dim`` (checked by the
    caller) and v's ``head_dim_v`` (None: q's)."""
    if head_dim_v is None:
        return manifest.kernel_head_dim(kind, head_dim)
    checks.check_sizes(head_dim_v=head_dim_v)
    return manifest.kernel_head_dim(kind, max(head_dim, head_dim_v))


def repeat_key(kind: str, arrays, options, stream):
    """A call of DeviceArrays on an int stream, as given: the key a repeated call with the
    same arguments is launched again under at once (its checks were made the first time;
    the host path, benchmarks/launch_overhead.py); None for other arguments. The arrays
    are named by id, which hashes at C speed (a DeviceArray's own hash is Python code):
    the plan kept under the key pins them (``KernelLibrary.launch``'s aliases), so no
    other array takes an id while the key is kept, and a DeviceArray cannot change."""
    if type(stream) is not int:
        return None
    for a in arrays:
        if type(a) is not DeviceArray:
            return None
    return (kind, *map(id, arrays), *options, stream)


def backward_rows(manifest, head_dim: int, causal, deterministic, dtype: str | None, varlen: bool,
                  local: bool = False) -> list:
    """The built backward rows of these axes (any dtype where None; ``local``: the local
    rows, which serve a window or sinks, causal or not), whose workspace rules size a
    workspace for whichever the backward picks; a typed error if none."""
    axes = {"kind": "bwd", "head_dim": head_dim, "causal": checks.flag("causal", causal),
            "deterministic": checks.flag("deterministic", deterministic), "varlen": varlen}
    axes["local"] = checks.flag("local", local)
    if axes["local"]:
        axes["causal"] = False
    if dtype is not None:
        axes["dtype"] = dtype
    rows = manifest.matching(**axes)
    if not rows:
        raise UnsupportedVariantError(f"no backward kernel is built for {axes}; built: "
                                      f"{', '.join(sorted(n for n in manifest.rows if n.startswith('bwd.')))}")
    return rows


