"""manifest.json: the launch contract of every built cubin, read and checked.

The manifest is written by build_kernels.py; see its rows for the fields. This module only
reads: it checks the schema once at load, finds a row for a variant, and hands out cubin
bytes after verifying their sha256.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

from .errors import ChecksumError, ManifestError, UnsupportedVariantError
from .variants import NOT_BUILT_REASONS, Variant, matches

SCHEMA = 11  # 11: the decode and combine kinds; 3: the q_tiles axis (forward query tiles per CTA); 4: launches[].programmatic;
# 5: the grid rules "const" and "persistent" (loader.grid_of); 6: the backward's run-time
# "first_write" value (the dQ accumulator uncleared, first shares stored); 7: first_write
# for the deterministic backward too, the postprocess's seqlen_k; 8: the workspace's
# dq_done counters (the postprocess waits per head, not for the whole main grid); 9: the
# backward's split last wave (grid rule "split_tail", its counters and partial sums); 10:
# backward rows carry their "config" and "workspace" rule (the run time reads them)
ROW_FIELDS = (
    "name", "variant", "file", "sha256", "size", "arch", "compute_capability", "launches", "tensormaps",
)
KIND_FIELDS = {"bwd": ("config", "workspace"), "decode": ("config", "workspace")}  # row fields a kind needs besides ROW_FIELDS
LAUNCH_FIELDS = ("symbol", "block", "cluster", "grid", "smem_bytes", "programmatic", "params")
TOP_FIELDS = ("schema", "package_version", "toolchain", "driver_floor", "kernels")
PACKAGE_DIR = Path(__file__).resolve().parent


class Manifest:
    """The manifest.json in ``folder`` and the cubins under ``folder/cubins``."""

    def __init__(self, folder: Path | str = PACKAGE_DIR):
        self.folder = Path(folder)
        path = self.folder / "manifest.json"
        if not path.exists():
            raise ManifestError(
                f"{path} does not exist: no kernels are built. Run `python build_kernels.py` "
                "in the source tree, or install a wheel that ships cubins."
            )
        try:
            self.data = json.loads(path.read_text())
        except ValueError as e:
            raise ManifestError(f"{path} is not valid JSON ({e}); rebuild or reinstall") from e
        self._validate(path)
        self.rows = {row["name"]: row for row in self.data["kernels"]}
        # find() and built() by their sorted axes: launches ask the same few questions again
        self._found: dict[tuple, dict] = {}
        self._built: dict[tuple, bool] = {}
        self._matching: dict[tuple, list] = {}

    def _validate(self, path: Path) -> None:
        missing = [k for k in TOP_FIELDS if k not in self.data]
        if missing:
            raise ManifestError(f"{path} lacks {missing}; rebuild with build_kernels.py")
        if self.data["schema"] != SCHEMA:
            raise ManifestError(
                f"{path} has schema {self.data['schema']}, this fa4_aot reads {SCHEMA}; "
                "rebuild the kernels with this version"
            )
        for row in self.data["kernels"]:
            lacking = [k for k in ROW_FIELDS if k not in row]
            lacking += [k for k in KIND_FIELDS.get(row.get("variant", {}).get("kind"), ()) if k not in row]
            lacking += [f"launches[{i}].{k}" for i, launch in enumerate(row.get("launches", []))
                        for k in LAUNCH_FIELDS if k not in launch]
            if lacking:
                raise ManifestError(f"{path}: row {row.get('name')} lacks {lacking}")

    @property
    def driver_floor(self) -> int:
        return int(self.data["driver_floor"]["cuda_version"])

    @cached_property
    def variants(self) -> list[Variant]:
        return [Variant.from_dict(r["variant"]) for r in self.data["kernels"]]

    def row(self, variant: Variant) -> dict:
        row = self.rows.get(variant.name)
        if row is None:
            raise UnsupportedVariantError(self._not_built_message(variant))
        return row

    def matching(self, **axes) -> list:
        """The rows whose variants have these axis values (any others), kept per question:
        the backward asks it on every call that sizes its workspace."""
        key = tuple(sorted(axes.items()))
        rows = self._matching.get(key)
        if rows is None:
            rows = self._matching[key] = [r for r in self.data["kernels"]
                                          if all(r["variant"].get(axis) == value for axis, value in axes.items())]
        return rows

    def built(self, **axes) -> bool:
        """Whether the variant with these axes is in this build (False for undeclared values)."""
        key = tuple(sorted(axes.items()))
        if key not in self._built:
            try:
                self._built[key] = Variant(**axes).name in self.rows
            except ValueError:
                self._built[key] = False
        return self._built[key]

    def find(self, **axes) -> dict:
        """The row for a variant given by its axes; a typed error names the nearest built ones."""
        key = tuple(sorted(axes.items()))
        row = self._found.get(key)
        if row is None:
            row = self._found[key] = self._find(axes)
        return row

    def _find(self, axes: dict) -> dict:
        try:
            variant = Variant(**axes)
        except ValueError as e:
            nearest = sorted(
                self.variants,
                key=lambda x: (x.dtype != axes.get("dtype"), abs(x.head_dim - axes.get("head_dim", 0)),
                               x.causal != axes.get("causal")),
            )
            names = ", ".join(x.name for x in nearest[:4]) or "none"
            raise UnsupportedVariantError(f"no kernel for {axes}: {e}. Nearest built variants: {names}.") from None
        return self.row(variant)

    def _not_built_message(self, v: Variant) -> str:
        reasons = [why for key, why in NOT_BUILT_REASONS.items() if matches(v, key)]
        same_kind = [x for x in self.variants if x.kind == v.kind and x.arch == v.arch] or self.variants
        same_kind.sort(key=lambda x: (x.dtype != v.dtype, abs(x.head_dim - v.head_dim), x.causal != v.causal))
        nearest = ", ".join(x.name for x in same_kind[:4]) or "none"
        why = f" ({'; '.join(reasons)})" if reasons else ""
        return f"{v.name} is not built{why}. Nearest built variants: {nearest}."

    def cubin(self, row: dict) -> bytes:
        path = self.folder / row["file"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ManifestError(f"cannot read {path} ({e}); rebuild or reinstall") from e
        digest = hashlib.sha256(data).hexdigest()
        if digest != row["sha256"] or len(data) != row["size"]:
            raise ChecksumError(
                f"{path} has sha256 {digest} ({len(data)} bytes); the manifest says "
                f"{row['sha256']} ({row['size']} bytes). The file is corrupt or was replaced: "
                "reinstall fa4_aot or rebuild with build_kernels.py."
            )
        return data


