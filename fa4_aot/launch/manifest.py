"""manifest.json: the launch contract of every built cubin, read and checked.

The manifest is written by build_kernels.py (its text laid out by ``dumps``); see its rows
for the fields. This module reads it lazily: at load only the small header and the index
(each row's variant and where its text lies) are decoded, and a row when it is first asked
for, checked then; ``data`` decodes and checks the whole file (``fa4-aot verify``, list).
Cubin bytes are handed out after their sha256 is verified, one file at a time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path

from ..errors import ChecksumError, ManifestError, UnsupportedVariantError
from ..variants import EXACT_HEAD_DIMS, NOT_BUILT_REASONS, Variant, matches, serving_head_dim

SCHEMA = 14  # 14: rows' "limits" (what a launch may ask), "values" (launch values derived by fa4_aot.launch.rules expressions, also in grids, workspace counts and tensor-map boxes), launch slots name their sources (kinds "extents" and "stride" read the launch tensors; fa4_aot/src/common/params.py), tensor inputs by the public names; 13: launches[].when (a run-time value; the launch is left out where it is 0: the varlen forward's sort); 12: the decode and combine kinds, the lazily read layout (index, rows last); 3: the q_tiles axis (forward query tiles per CTA); 4: launches[].programmatic;
# 5: the grid rules "const" and "persistent" (loader.grid_of); 6: the backward's run-time
# "first_write" value (the dQ accumulator uncleared, first shares stored); 7: first_write
# for the deterministic backward too, the postprocess's seqlen_k; 8: the workspace's
# dq_done counters (the postprocess waits per head, not for the whole main grid); 9: the
# backward's split last wave (grid rule "split_tail", its counters and partial sums); 10:
# backward rows carry their "config" and "workspace" rule (the run time reads them); 12:
# the "index" (each row's variant and text span), "kernels" last (11: another branch's)
ROW_FIELDS = (
    "name", "variant", "file", "sha256", "size", "arch", "compute_capability", "launches", "tensormaps", "limits",
)
KIND_FIELDS = {"bwd": ("config", "workspace"), "decode": ("config", "workspace")}  # row fields a kind needs besides ROW_FIELDS
LAUNCH_FIELDS = ("symbol", "block", "cluster", "grid", "smem_bytes", "programmatic", "params")
TOP_FIELDS = ("schema", "package_version", "toolchain", "driver_floor", "kernels")
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the fa4_aot package: manifest.json, cubins/
_DECODER = json.JSONDecoder()


def _skip_space(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def dumps(head: dict, rows: list[dict]) -> str:
    """The manifest's text: ``head``'s fields, then the index, then the rows ("kernels",
    last). The index gives each row's variant and its text's span [start, length] in
    characters from the "[" that opens "kernels", so a reader decodes only the rows it
    needs (``Manifest``); any JSON reader still reads the whole."""
    texts = [json.dumps(row, indent=1) for row in rows]
    spans, at = {}, 2  # past "[\n"
    for row, text in zip(rows, texts):
        spans[row["name"]] = {"variant": row["variant"], "at": [at, len(text)]}
        at += len(text) + 2  # and ",\n"
    kernels = "[\n" + ",\n".join(texts) + "\n]"
    head_text = json.dumps({**head, "schema": SCHEMA, "index": {"kernels_chars": len(kernels), "rows": spans}},
                           indent=1)
    return head_text[:-2] + ',\n "kernels": ' + kernels + "\n}\n"


def rewrite(path: Path, edit) -> list[dict]:
    """Rewrite the manifest at ``path`` with ``edit(rows)``'s rows in place of its rows, its
    head kept (an A/B library's trim, a swap into the package); returns the new rows."""
    head = json.loads(path.read_text())
    head.pop("index", None)
    rows = edit(head.pop("kernels"))
    path.write_text(dumps(head, rows))
    return rows


class Manifest:
    """The manifest.json in ``folder`` and the cubins under ``folder/cubins``."""

    def __init__(self, folder: Path | str = PACKAGE_DIR):
        self.folder = Path(folder)
        self.path = path = self.folder / "manifest.json"
        if not path.exists():
            raise ManifestError(
                f"{path} does not exist: no kernels are built. Run `python build_kernels.py` "
                "in the source tree, or install a wheel that ships cubins."
            )
        try:
            self._text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ManifestError(f"cannot read {path} ({e}); rebuild or reinstall") from e
        # the header and index, where the file has them as ``dumps`` lays them out; else
        # (any other layout of the same JSON) everything, now
        self.head, self._kernels_at = self._scan()
        if self._kernels_at is None:
            self.head = {k: v for k, v in self.data.items() if k not in ("kernels", "index")}
            self.index = {r["name"]: {"variant": r["variant"]} for r in self.data["kernels"]}
        self._check_head(self.head)
        self.rows = _Rows(self)
        # find() and built() by their sorted axes: launches ask the same few questions again
        self._found: dict[tuple, dict] = {}
        self._built: dict[tuple, bool] = {}
        self._matching: dict[tuple, list] = {}
        self._head_dims: dict[tuple, int] = {}
        self._head_dims_v: dict[tuple, int] = {}

    def _scan(self) -> tuple[dict, int | None]:
        """(the top-level fields before "kernels", where the "kernels" array starts), the
        fields decoded one by one; (_, None) where the file is not laid out as ``dumps``
        does (no index before "kernels", or its span not the array's)."""
        text, head = self._text, {}
        try:
            i = _skip_space(text, 0)
            if text[i] != "{":
                return head, None
            i += 1
            while True:
                i = _skip_space(text, i)
                key, i = _DECODER.raw_decode(text, i)
                i = _skip_space(text, i)
                if text[i] != ":":
                    return head, None
                i = _skip_space(text, i + 1)
                if key == "kernels":
                    break
                head[key], i = _DECODER.raw_decode(text, i)
                i = _skip_space(text, i)
                if text[i] != ",":
                    return head, None
                i += 1
            index = head.pop("index", None)
            end = i + index["kernels_chars"]
            if text[i] != "[" or text[end - 1] != "]" or text[_skip_space(text, end)] != "}":
                return head, None
            self.index = index["rows"]
            return head, i
        except (ValueError, IndexError, KeyError, TypeError):
            return head, None  # not the layout: data (below) says what is wrong, if anything

    def _check_head(self, head: dict) -> None:
        """The top-level fields (but "kernels", which a lazy read has not decoded) and schema."""
        missing = [k for k in TOP_FIELDS if k not in head and k != "kernels"]
        if missing:
            raise ManifestError(f"{self.path} lacks {missing}; rebuild with build_kernels.py")
        if head["schema"] != SCHEMA:
            raise ManifestError(
                f"{self.path} has schema {head['schema']}, this fa4_aot reads {SCHEMA}; "
                "rebuild the kernels with this version"
            )

    @cached_property
    def data(self) -> dict:
        """The whole manifest, decoded and every row checked."""
        try:
            data = json.loads(self._text)
        except ValueError as e:
            raise ManifestError(f"{self.path} is not valid JSON ({e}); rebuild or reinstall") from e
        missing = [k for k in TOP_FIELDS if k not in data]
        if missing:
            raise ManifestError(f"{self.path} lacks {missing}; rebuild with build_kernels.py")
        self._check_head(data)
        for row in data["kernels"]:
            self._check_row(row)
        return data

    def _check_row(self, row) -> None:
        lacking = [k for k in ROW_FIELDS if k not in row]
        lacking += [k for k in KIND_FIELDS.get(row.get("variant", {}).get("kind"), ()) if k not in row]
        lacking += [f"launches[{i}].{k}" for i, launch in enumerate(row.get("launches", []))
                    for k in LAUNCH_FIELDS if k not in launch]
        if lacking:
            raise ManifestError(f"{self.path}: row {row.get('name')} lacks {lacking}")

    def _row(self, name: str) -> dict:
        """Row ``name`` (in the index), decoded from its span and checked."""
        if self._kernels_at is None:
            return next(r for r in self.data["kernels"] if r["name"] == name)
        start, length = self.index[name]["at"]
        start += self._kernels_at
        try:
            row, end = _DECODER.raw_decode(self._text, start)
        except ValueError:
            row, end = None, None
        if not isinstance(row, dict) or row.get("name") != name or end != start + length:
            raise ManifestError(f"{self.path}: the index's span of {name} does not hold that row; "
                                "the file was edited: rebuild or reinstall")
        self._check_row(row)
        return row

    @property
    def driver_floor(self) -> int:
        return int(self.head["driver_floor"]["cuda_version"])

    @cached_property
    def variants(self) -> list[Variant]:
        return [Variant.from_dict(entry["variant"]) for entry in self.index.values()]

    @cached_property
    def archs(self) -> list[str]:
        """The matrix architectures built here ("sm90a", ...), sorted."""
        return sorted({entry["variant"]["arch"] for entry in self.index.values()})

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
            rows = self._matching[key] = [self.rows[name] for name, entry in self.index.items()
                                          if all(entry["variant"].get(axis) == value for axis, value in axes.items())]
        return rows

    def workspace_rules(self, **axes) -> tuple:
        """The distinct workspace rules of the rows ``matching(**axes)``, kept per question:
        a size asked per call (the varlen forward's, by every call that sizes or checks its
        workspace) evaluates each once, not once a row (the varlen forward rows share one)."""
        key = ("workspace",) + tuple(sorted(axes.items()))
        rules = self._matching.get(key)
        if rules is None:
            distinct = {json.dumps(r["workspace"], sort_keys=True): r["workspace"] for r in self.matching(**axes)}
            rules = self._matching[key] = tuple(distinct.values())
        return rules

    def kernel_head_dim(self, kind: str, head_dim: int) -> int:
        """The head dim of the ``kind`` kernels that serve tensors ``head_dim`` wide: the
        narrowest built one at least as wide (they read zeros past the tensors' columns and
        write nothing there: docs/design.md, "Head dims"), past 256 only its own width
        (512). A typed error where head_dim is
        not a positive multiple of 8 (a row is whole 16-byte units for TMA) or no built
        head dim of this kind is as wide."""
        key = (kind, head_dim)
        found = self._head_dims.get(key)
        if found is None:
            dims = sorted({v.head_dim for v in self.variants if v.kind == kind})
            found = serving_head_dim(dims, head_dim)
            if found is None:
                riding = [d for d in dims if d not in EXACT_HEAD_DIMS]
                exact = [d for d in dims if d in EXACT_HEAD_DIMS]
                raise UnsupportedVariantError(
                    f"head_dim {head_dim}: the {kind} kernels serve multiples of 8 up to {max(riding, default=0)}"
                    + (f" and exactly {', '.join(map(str, exact))}" if exact else "")
                    + f" (built: {', '.join(map(str, dims)) or 'none'}; a narrower head dim runs on the next wider)")
            self._head_dims[key] = found
        return found

    def own_head_dim_v(self, axes: dict, columns_v: int) -> dict:
        """``axes`` (kind, dtype, head_dim, ...) with the narrowest ``head_dim_v`` built
        beside them that holds v's ``columns_v`` columns (a kernel of v's own width,
        narrower than q's: 192/128, docs/design.md "Head dims"); as given where none is
        (v then runs on q's head dim)."""
        key = (columns_v, *sorted(axes.items()))
        found = self._head_dims_v.get(key)
        if found is None:
            widths = [entry["variant"].get("head_dim_v", 0) for entry in self.index.values()
                      if all(entry["variant"].get(axis) == value for axis, value in axes.items())]
            found = self._head_dims_v[key] = min((w for w in widths if w >= columns_v), default=0)
        return {**axes, "head_dim_v": found} if found else axes

    def built(self, **axes) -> bool:
        """Whether the variant with these axes is in this build (False for undeclared values)."""
        key = tuple(sorted(axes.items()))
        if key not in self._built:
            try:
                self._built[key] = Variant(**axes).name in self.index
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
            names = ", ".join(self._nearest(axes)) or "none"
            raise UnsupportedVariantError(f"no kernel for {axes}: {e}. Nearest built variants: {names}.") from None
        return self.row(variant)

    def _nearest(self, axes: dict, count: int = 4) -> list[str]:
        """Built variants of the same kind closest to ``axes``: one per head dim, the
        nearest head dims first (same dtype and causal preferred, plain forms first)."""
        pool = [x for x in self.variants if x.kind == axes.get("kind")] or list(self.variants)
        pool.sort(key=lambda x: (abs(x.head_dim - axes.get("head_dim", 0)), x.dtype != axes.get("dtype"),
                                 (x.local, x.softcap) != (axes.get("local", False), axes.get("softcap", False)),
                                 x.causal != axes.get("causal"), x.varlen, x.deterministic, x.q_tiles))
        chosen, dims = [], set()
        for x in pool:
            if x.head_dim not in dims:
                dims.add(x.head_dim)
                chosen.append(x.name)
        return chosen[:count]

    def _not_built_message(self, v: Variant) -> str:
        reasons = [why for key, why in NOT_BUILT_REASONS.items() if matches(v, key)]
        same_kind = [x for x in self.variants if x.kind == v.kind and x.arch == v.arch] or self.variants
        same_kind.sort(key=lambda x: (x.dtype != v.dtype, abs(x.head_dim - v.head_dim),
                                      (x.local, x.softcap) != (v.local, v.softcap), x.causal != v.causal))
        nearest = ", ".join(x.name for x in same_kind[:4]) or "none"
        why = f" ({'; '.join(reasons)})" if reasons else ""
        return f"{v.name} is not built{why}. Nearest built variants: {nearest}."

    def cubin(self, row: dict) -> bytes:
        path = self.folder / row["file"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ManifestError(f"cannot read {path} ({e}); rebuild or reinstall") from e
        import hashlib  # here, not at import: its OpenSSL load is a fresh process's first-call cost either way

        digest = hashlib.sha256(data).hexdigest()
        if digest != row["sha256"] or len(data) != row["size"]:
            raise ChecksumError(
                f"{path} has sha256 {digest} ({len(data)} bytes); the manifest says "
                f"{row['sha256']} ({row['size']} bytes). The file is corrupt or was replaced: "
                "reinstall fa4_aot or rebuild with build_kernels.py."
            )
        return data




class _Rows(Mapping):
    """A manifest's rows by name, each decoded on first use and kept."""

    def __init__(self, manifest: Manifest):
        self._manifest, self._decoded = manifest, {}

    def __getitem__(self, name: str) -> dict:
        row = self._decoded.get(name)
        if row is None:
            if name not in self._manifest.index:
                raise KeyError(name)
            row = self._decoded[name] = self._manifest._row(name)
        return row

    def __contains__(self, name) -> bool:
        return name in self._manifest.index

    def __iter__(self):
        return iter(self._manifest.index)

    def __len__(self) -> int:
        return len(self._manifest.index)
