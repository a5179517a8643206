"""The variant matrix: the one place that says which kernels exist.

A ``Variant`` is at once the compile key, the manifest row's key, the cubin's file name,
the test id and the run-time selection key; its ``name`` reads like
``fwd.sm90a.bf16.d128.causal``. ``MATRIX`` is every variant this release builds, and
``AXES`` says, per axis, which values are built and which are not yet: the CLI and the
manifest print it so nobody has to guess.

Imports nothing beyond the standard library: the runtime uses it to select kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

ARCHS = ("sm90a", "sm100a")
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 96, 128, 192, 256, 512)
# Head dims served only by kernels of exactly their width: past 256 a narrower tensor does
# not ride on a wider kernel (512 is Gemma 4's; 264-504 are no model's, and at 512 they
# would do up to twice their matrix work): docs/design.md, "Head dims"
EXACT_HEAD_DIMS = (512,)

# What each axis can take, and what this release builds of it. Kept in sync with MATRIX by
# a CPU test.
AXES = {
    # decode: a few query tokens against a KV cache, GQA-packed, split-KV, paged or not
    # (one kernel: packing and paging are how it reads, the splits a launch value);
    # combine: the split-KV merge of the decode's partial outputs
    "kind": {"declared": ("fwd", "bwd", "decode", "combine"), "built": ("fwd", "bwd", "decode", "combine")},
    "arch": {"declared": ARCHS, "built": ("sm90a",)},
    "dtype": {"declared": DTYPES, "built": DTYPES},
    "head_dim": {"declared": HEAD_DIMS, "built": HEAD_DIMS},
    "causal": {"declared": (False, True), "built": (False, True)},
    "varlen": {"declared": (False, True), "built": (False, True)},
    "cta_mode": {"declared": (1, 2), "built": (1,)},
    "deterministic": {"declared": (False, True), "built": (False, True)},
    "q_tiles": {"declared": (1, 2), "built": (1, 2)},
    # a sliding window (left, right keys at run time: one cubin serves every window, causal
    # and unbounded included) and attention sinks (a logit per query head at run time, or none)
    "local": {"declared": (False, True), "built": (False, True)},
    # scores capped as cap * tanh(s / cap) (the cap at run time)
    "softcap": {"declared": (False, True), "built": (False, True)},
    # the KV cache's element type: q's ("same") or FP8 e4m3 with fp32 dequantization scales
    # per (sequence, KV head), widened to q's dtype on chip (decode only)
    "kv_dtype": {"declared": ("same", "e4m3"), "built": ("same", "e4m3")},
    # v's (and out's) head dim where a kernel of its own serves it narrower than q's: 0 for
    # q's; 128 beside 192 (DeepSeek V3-family prefill), whose forward then computes P V and
    # stores O 128 columns wide instead of 192 (docs/design.md, "Head dims")
    "head_dim_v": {"declared": (0, 128), "built": (0, 128)},
    # decode with a window: "narrow", tiles for a bounded window's few keys (32-key tiles,
    # four CTAs an SM), chosen by policy.decode_narrow; "any", every cache and window
    # (docs/design.md, "Local attention, sinks, softcap": windowed decode)
    "span": {"declared": ("any", "narrow"), "built": ("any", "narrow")},
}
# What a call may give beyond an axis's built values, printed by `fa4-aot list --all`.
AXIS_NOTES = {
    "head_dim": "tensors of any multiple of 8 up to 256 run on the narrowest built head dim at least as wide "
                "(zeros past their columns, nothing written there), v's head dim its own or q's (192/128: the "
                "forward on its own d192v128 kernels, the backward and decode on the d192 ones) "
                "(docs/design.md, \"Head dims\")",
}
# What each kind is, and the forms it takes at run time (no axis of their own: one cubin
# serves them), printed by `fa4-aot list --all`.
KINDS = {
    "fwd": "forward, dense (b, s, h, d) or packed varlen (cu_seqlens)",
    "bwd": "backward (preprocess, main kernel, postprocess), dense or packed varlen",
    "decode": "a few query tokens against a KV cache: GQA-packed rows (the query heads of a KV head in one "
              "tile), split-KV (num_splits at run time), contiguous or paged cache (page_table at run time, "
              "page sizes multiples of 16)",
    "combine": "the split-KV merge of decode's partial O and LSE (launched when num_splits > 1)",
}
# Per kind, the axes whose built values differ from AXES (head_dim 512: no backward,
# NOT_BUILT_REASONS says why).
_UP_TO_256 = tuple(d for d in HEAD_DIMS if d <= 256)
KIND_AXES = {
    "fwd": {"deterministic": (False,), "kv_dtype": ("same",), "span": ("any",)},
    "bwd": {"kv_dtype": ("same",), "head_dim": _UP_TO_256, "span": ("any",)},
    "decode": {"varlen": (False,), "deterministic": (False,), "q_tiles": (1,), "head_dim_v": (0,)},
    "combine": {"causal": (False,), "varlen": (False,), "deterministic": (False,), "q_tiles": (1,),
                "local": (False,), "softcap": (False,), "kv_dtype": ("same",), "head_dim_v": (0,), "span": ("any",)},
}

NOT_BUILT_REASONS = {
    "arch=sm100a": "no Blackwell kernel is written yet; the sm90a kernels use wgmma, "
    "which sm_100a does not have",
    "kind=bwd,varlen=True,q_tiles=2": "packed sequences take one query tile per backward step",
    "kind=fwd,varlen=True,q_tiles=2": "packed sequences take one query tile per CTA",
    "cta_mode=2": "2-CTA mode (cluster pairs that add dQ before the reduce) measured slower than one CTA "
    "on sm90a; not built (docs/design.md, \"What was tried and rejected\")",
    "kind=fwd,deterministic=True": "the forward is deterministic already; the axis is the backward's",
    "kind=decode,varlen=True": "decode takes each sequence's cache length (cache_seqlens) and pages instead",
    "kind=decode,deterministic=True": "decode is deterministic for a given num_splits already",
    "kind=decode,q_tiles=2": "decode packs query tokens and heads into one 64-row tile per KV head",
    "local=True,causal=True": "the local kernels take causal as a window (right = 0)",
    "local=False,softcap=True": "softcap is built into the local kernels, which serve every window "
    "(unbounded and causal included)",
    "kind=combine,local=True": "the combine merges rows whatever the mask was",
    "kind=combine,softcap=True": "the combine merges rows whatever the scores were",
    "kind=combine,causal=True": "the combine merges rows whatever the mask was",
    "kind=combine,varlen=True": "the combine merges rows whatever the layout was",
    "kind=combine,deterministic=True": "the combine sums the splits in order: deterministic already",
    "kind=combine,q_tiles=2": "the combine has no query tiles",
    "kind=fwd,kv_dtype=e4m3": "an FP8 KV cache is decode's (serving reads the cache for every token; "
    "prefill and training read K and V in q's dtype)",
    "kind=bwd,kv_dtype=e4m3": "an FP8 KV cache is decode's: there is no backward through a cache",
    "kind=combine,kv_dtype=e4m3": "the combine merges fp32 partials whatever the cache held",
    # decode's span: the narrow-window kernels, built where a model needs them (gpt-oss)
    "local=False,span=narrow": "without a window every key of the cache is read: the span-any kernels",
    **{f"head_dim={d},span=narrow": "narrow-window decode is built at head_dim 64 (gpt-oss's 128-key windows); "
       "wider heads' windows (Gemma, Mistral: 1024-4096 keys) take the span-any kernels" for d in HEAD_DIMS if d != 64},
    "softcap=True,span=narrow": "narrow-window decode is built without a cap (gpt-oss has none); a capped call "
    "takes the span-any kernels",
    "kv_dtype=e4m3,span=narrow": "an FP8 cache's windows take the span-any kernels (narrow FP8 tiles not measured)",
    # the backward's q_tiles: query tiles per step, where a variant has both kernels
    "kind=bwd,causal=False,q_tiles=2": "not causal, head_dim 64 steps over two query tiles already (q_tiles 1)",
    "kind=bwd,deterministic=True,q_tiles=2": "deterministic, head_dim 64 steps over two query tiles already "
    "(q_tiles 1)",
    **{f"kind=bwd,head_dim={d},q_tiles=2": "two query tiles per backward step are built at head_dim 64 only"
       for d in (96, 128, 192, 256)},
    **{f"kind=fwd,head_dim={d},q_tiles=2": f"two Q buffers do not fit 227 KB of shared memory at head_dim {d}"
       for d in (192, 256)},
    # v's own head dim: the forward's and backward's 192/128 (decode serves it on its d192
    # kernels, v's columns past 128 read as zeros and never written)
    **{f"head_dim={d},head_dim_v=128": "a v wider than q runs on the kernels of v's head dim (d128)"
       for d in (64, 96)},
    "head_dim=128,head_dim_v=128": "v as wide as q is head_dim_v 0 (q's)",
    "head_dim=256,head_dim_v=128": "v narrower than q has kernels of its own only beside q's 192 (DeepSeek V3's "
    "192/128); 256/128 runs on the d256 kernels",
    "local=True,head_dim_v=128": "windows, sinks and softcap at 192/128 run on the d192 local kernels",
    "kind=decode,head_dim_v=128": "decode at 192/128 runs on the d192 kernels",
    "kind=combine,head_dim_v=128": "the combine merges rows of any width on its d192 kernel",
    # head_dim 512: two consumer warpgroups split the head dim (O of 64 rows is 256
    # registers a thread): the forward (dense and varlen) and decode, causal or not, GQA
    "kind=bwd,head_dim=512": "the head_dim 512 backward is not written (dK, dV and dQ of a 64-key tile at 512 "
    "columns exceed one CTA's registers; docs/design.md, \"Head dims\")",
    "kind=decode,head_dim=512,kv_dtype=e4m3": "an FP8 cache at head_dim 512 is not written yet",
    "kind=fwd,head_dim=512,q_tiles=2": "two Q buffers do not fit 227 KB of shared memory at head_dim 512",
    "local=True,head_dim=512": "windows, sinks and softcap at head_dim 512 are not written yet",
    "head_dim=512,head_dim_v=128": "v's own head dim is built beside q's 192 only",
    **{f"kind=fwd,local=True,head_dim={d},q_tiles=2": "two local query tiles per CTA measured slower than one "
       "at head_dim 128 for every window (128: 89 against 111 TFLOP/s; 1024: 225 against 318)" for d in (96, 128)},
}


@dataclass(frozen=True, order=True)
class Variant:
    kind: str
    arch: str
    dtype: str
    head_dim: int
    causal: bool
    varlen: bool = False
    cta_mode: int = 1
    deterministic: bool = False
    # forward: query tiles per CTA, Q double-buffered when 2 (``.q2``); backward: query
    # tiles per step where a variant has both kernels (its config's step_tiles)
    q_tiles: int = 1
    local: bool = False  # sliding window and sinks (run-time values)
    softcap: bool = False  # cap * tanh(s / cap) on the scores
    kv_dtype: str = "same"  # decode's cache: q's dtype, or "e4m3" (FP8, dequantization scales at run time)
    head_dim_v: int = 0  # v's head dim where a kernel of its own serves it, 0: q's (head_dim)
    span: str = "any"  # decode: "narrow", tiles for a bounded window's few keys

    def __post_init__(self):
        for axis, spec in AXES.items():
            value = getattr(self, axis)
            if value not in spec["declared"]:
                raise ValueError(f"{axis}={value!r} is not one of {spec['declared']}")

    @property
    def name(self) -> str:
        head_dims = f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v else "")
        parts = [self.kind, self.arch, self.dtype, head_dims]
        if self.causal:
            parts.append("causal")
        if self.varlen:
            parts.append("varlen")
        if self.cta_mode != 1:
            parts.append(f"cta{self.cta_mode}")
        if self.deterministic:
            parts.append("det")
        if self.q_tiles != 1:
            parts.append(f"q{self.q_tiles}")
        if self.local:
            parts.append("local")
        if self.softcap:
            parts.append("softcap")
        if self.kv_dtype != "same":
            parts.append(f"kv_{self.kv_dtype}")
        if self.span != "any":
            parts.append(self.span)
        return ".".join(parts)

    @property
    def cubin_file(self) -> str:
        return f"{self.name}.cubin"

    @property
    def gpu_arch(self) -> str:
        """The DSL's and ptxas' spelling: sm_90a."""
        return self.arch[:-1].replace("sm", "sm_") + "a"

    @property
    def compute_capability(self) -> tuple[int, int]:
        digits = self.arch[2:-1]
        return int(digits[:-1]), int(digits[-1])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Variant":
        return cls(**d)

    @classmethod
    def from_name(cls, name: str) -> "Variant":
        for v in matrix():
            if v.name == name:
                return v
        raise KeyError(name)


ARCH_OF_CAPABILITY = {(9, 0): "sm90a", (10, 0): "sm100a"}


def arch_for_capability(cc: tuple[int, int]) -> str | None:
    """The matrix's architecture whose cubins run on a device of compute capability ``cc``."""
    return ARCH_OF_CAPABILITY.get(tuple(cc))


def serving_head_dim(built_dims, head_dim: int) -> int | None:
    """The built head dim whose kernels serve tensors ``head_dim`` wide: the narrowest of
    ``built_dims`` at least as wide, an EXACT_HEAD_DIMS one only for its own width
    (docs/design.md, "Head dims"); None where head_dim is not a positive multiple of 8
    (TMA rows are whole 16-byte units) or none serves it."""
    if head_dim <= 0 or head_dim % 8:
        return None
    if head_dim in EXACT_HEAD_DIMS:
        return head_dim if head_dim in built_dims else None
    return min((d for d in built_dims if d >= head_dim and d not in EXACT_HEAD_DIMS), default=None)


def built_values(kind: str, axis: str) -> tuple:
    return KIND_AXES.get(kind, {}).get(axis, AXES[axis]["built"])


def _build_matrix() -> tuple[Variant, ...]:
    out = []
    for kind in AXES["kind"]["built"]:
        for arch in built_values(kind, "arch"):
            for dtype in built_values(kind, "dtype"):
                for head_dim in built_values(kind, "head_dim"):
                    for causal, varlen in itertools.product(built_values(kind, "causal"),
                                                            built_values(kind, "varlen")):
                        for det, q_tiles, local, softcap, kv_dtype, head_dim_v, span in itertools.product(
                                built_values(kind, "deterministic"), built_values(kind, "q_tiles"),
                                built_values(kind, "local"), built_values(kind, "softcap"),
                                built_values(kind, "kv_dtype"), built_values(kind, "head_dim_v"),
                                built_values(kind, "span")):
                            v = Variant(kind, arch, dtype, head_dim, causal, varlen=varlen, deterministic=det,
                                        q_tiles=q_tiles, local=local, softcap=softcap, kv_dtype=kv_dtype,
                                        head_dim_v=head_dim_v, span=span)
                            if not any(matches(v, key) for key in NOT_BUILT_REASONS):
                                out.append(v)
    return tuple(sorted(out))


def matches(v: "Variant", key: str) -> bool:
    """Whether ``v`` has every axis value of a NOT_BUILT_REASONS key such as "kind=fwd,head_dim=192"."""
    return all(str(getattr(v, axis)) == value for axis, value in _parsed(key))


@functools.lru_cache(maxsize=None)
def _parsed(key: str) -> tuple[tuple[str, str], ...]:
    """A NOT_BUILT_REASONS key's (axis, value) pairs, split once: the matrix asks every
    key of every candidate variant at import."""
    return tuple(tuple(p.split("=")) for p in key.split(","))


@functools.lru_cache(maxsize=1)
def matrix() -> tuple[Variant, ...]:
    """``MATRIX``, built on first use (some 5 ms): the run time selects from the manifest
    and never needs it."""
    return _build_matrix()


def __getattr__(name: str):
    if name == "MATRIX":  # every variant this release builds (``matrix()``)
        return matrix()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def select(only: tuple[str, ...] = (), archs: tuple[str, ...] = ()) -> list[Variant]:
    """Variants whose name matches any glob in ``only`` (all when empty), in ``archs``."""
    import fnmatch

    chosen = []
    for v in matrix():
        if archs and v.arch not in archs:
            continue
        if only and not any(fnmatch.fnmatchcase(v.name, pat) for pat in only):
            continue
        chosen.append(v)
    return chosen


def nearest(kind: str, dtype: str, head_dim: int, causal: bool, arch: str | None = None) -> list[str]:
    """Names of built variants closest to a request, for error messages."""
    pool = [v for v in matrix() if v.kind == kind and (arch is None or v.arch == arch)]
    pool.sort(key=lambda v: (v.dtype != dtype, abs(v.head_dim - head_dim), v.causal != causal))
    return [v.name for v in pool[:4]]
