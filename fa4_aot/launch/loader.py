"""Load cubins with cuda-python and launch them from raw device pointers.

``KernelLibrary`` owns one manifest and, per CUDA context, the modules loaded from it.
Loading is lazy (first launch of a variant in a context) or explicit (``preload``). On
load it checks, before anything runs: the driver is new enough, the device's compute
capability is the cubin's, the cubin's sha256 is the manifest's, and the driver's own view
of the kernel's parameters (cuFuncGetParamInfo) is the manifest's plan.

The launch path allocates no device memory and never synchronizes: it encodes the TMA
descriptors on the host, packs the parameter buffer, and calls cuLaunchKernelEx on the
caller's stream, so it can be captured into a CUDA graph once ``preload`` has run. A call
the caller keys (``launch(..., key=)``; fa4_aot.dense keys every call by its arrays and
options) keeps its packed launches, and ``launch_again(key)`` repeats them: the same
arrays, options and stream give the same parameters, so the checks and the packing are
not done twice (PLANS_KEPT calls kept, least recently used dropped). A repeat asks the
driver one question (the current context) before its launches; numpy is not imported.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections import OrderedDict
from typing import NamedTuple
from pathlib import Path

from . import tma
from .rules import bind, evaluate
from .driver import SUCCESS, call, compute_capability, cu, device_name, failed, init, multiprocessor_count
from ..errors import AbiMismatchError, ArchitectureError, CudaError, DriverTooOldError
from .manifest import PACKAGE_DIR, Manifest
from ..variants import arch_for_capability


def _current_id() -> int | None:
    """The current context's id (None where none is current) in one driver call, as a
    handle comparison took: a NULL context asks for the current one's."""
    status, current_id = cu.cuCtxGetId(None)
    return current_id if status == SUCCESS else None


class _Context:
    """Make ``device``'s context current for a block: the caller's if it is on that
    device, else the device's primary context (the one frameworks use)."""

    _primary: dict[int, object] = {}
    _lock = threading.Lock()

    def __init__(self, device: int):
        self.device = device
        self.pushed = False

    def __enter__(self):
        current = call(cu.cuCtxGetCurrent)
        if int(current) != 0 and call(cu.cuCtxGetDevice) == self.device:
            self.handle = current
        else:
            with self._lock:
                ctx = self._primary.get(self.device)
                if ctx is None:
                    ctx = call(cu.cuDevicePrimaryCtxRetain, self.device)
                    self._primary[self.device] = ctx
            call(cu.cuCtxPushCurrent, ctx)
            self.handle, self.pushed = ctx, True
        # the context's id, unique for the process's life: a handle may be another
        # context's after the first is destroyed or reset, whose modules went with it
        self.id = int(call(cu.cuCtxGetId, self.handle))
        return self

    def __exit__(self, *exc):
        if self.pushed:
            call(cu.cuCtxPopCurrent)


PLANS_KEPT = 256  # launch plans (packed calls) kept per library


class Prepared(NamedTuple):
    """A call's launches, packed: the device and the context (its id) they were loaded
    in, the stream, and (function, config, parameter address, what keeps them alive) per
    launch."""

    device: int
    context: int
    stream: int
    plan: tuple


class KernelLibrary:
    """The kernels of one manifest folder (default: the cubins shipped in the package)."""

    def __init__(self, folder: Path | str = PACKAGE_DIR):
        self.folder = Path(folder)
        self._manifest = None
        self._functions: dict[tuple[int, str], object] = {}
        self._archs: dict[int, str] = {}
        self._sm_counts: dict[int, int] = {}
        self._events: dict[int, object] = {}  # context id -> CUevent (stream waits)
        self._lock = threading.RLock()
        # key -> (device, context id, stream, ((function, launch config, parameter pointers'
        # address, (pointer array, buffer)), ...), objects the key names by id)
        self._plans: OrderedDict = OrderedDict()

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            with self._lock:
                if self._manifest is None:
                    self._manifest = Manifest(self.folder)
        return self._manifest

    # ------------------------------------------------------------------ loading
    def arch(self, device: int) -> str:
        """The matrix architecture for ``device``; ArchitectureError if nothing here runs on it."""
        arch = self._archs.get(device)
        if arch is None:
            init()
            cc = compute_capability(device)
            arch = arch_for_capability(cc)
            built = self.manifest.archs
            if arch is None or arch not in built:
                spelt = sorted({v.gpu_arch for v in self.manifest.variants})
                raise ArchitectureError(
                    f"device {device} ({device_name(device)}) is sm_{cc[0]}{cc[1]}; the kernels here "
                    f"are built for {', '.join(spelt) or 'nothing'}. Use a GPU of that architecture."
                )
            self._archs[device] = arch
        return arch

    def sm_count(self, device: int) -> int:
        """The device's multiprocessors (one driver query per device): what a persistent
        kernel's grid takes (grid_of; other rules ignore it), and the backward's tail split
        (fa4_aot.dense)."""
        count = self._sm_counts.get(device)
        if count is None:
            count = self._sm_counts[device] = multiprocessor_count(device)
        return count

    def check_device(self, device: int, row: dict) -> None:
        """Driver floor and architecture; raises before any module is loaded."""
        version = init()
        floor = self.manifest.driver_floor
        if version < floor:
            raise DriverTooOldError(
                f"the CUDA driver supports CUDA {version // 1000}.{version % 1000 // 10}; these "
                f"cubins need {floor // 1000}.{floor % 1000 // 10} or newer "
                f"({self.manifest.head['driver_floor'].get('why', '')}). Update the NVIDIA driver "
                f"(to {self.manifest.head['driver_floor'].get('driver', 'a newer one')} or later)."
            )
        cc = compute_capability(device)
        if list(cc) != list(row["compute_capability"]):
            raise ArchitectureError(
                f"{row['name']} is built for {row['arch']} (compute capability "
                f"{row['compute_capability'][0]}.{row['compute_capability'][1]}), but device "
                f"{device} ({device_name(device)}) is {cc[0]}.{cc[1]}. Use a GPU of that "
                "architecture, or a wheel built for yours."
            )

    def functions(self, row: dict, device: int, context: int | None = None) -> list:
        """The CUfunction of each of ``row``'s launches in the current context (on ``device``);
        ``context``: its id (cuCtxGetId), where the caller has it already."""
        ctx = int(call(cu.cuCtxGetId, call(cu.cuCtxGetCurrent))) if context is None else context
        key = (ctx, row["name"])
        fns = self._functions.get(key)
        if fns is not None:
            return fns
        with self._lock:
            fns = self._functions.get(key)
            if fns is None:
                self.check_device(device, row)
                fns = self._load(row)
                self._functions[key] = fns
        return fns

    def _load(self, row: dict) -> list:
        image = self.manifest.cubin(row)
        module = call(cu.cuModuleLoadData, image)
        fns = []
        for launch in row["launches"]:
            fn = call(cu.cuModuleGetFunction, module, launch["symbol"].encode())
            if launch["smem_bytes"]:
                call(cu.cuFuncSetAttribute, fn,
                     cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                     launch["smem_bytes"])
            self._check_params(fn, row["name"], launch)
            fns.append(fn)
        return fns

    def _check_params(self, fn, name: str, launch: dict) -> None:
        got = []
        for i in range(len(launch["params"]) + 1):
            try:
                offset, size = call(cu.cuFuncGetParamInfo, fn, i)
            except CudaError:
                break
            got.append((int(offset), int(size)))
        if not got:
            return  # this driver cannot report parameters
        base = got[0][0]
        got = [(o - base, s) for o, s in got]
        want = [(p["offset"], p["size"]) for p in launch["params"]]
        if got != want:
            raise AbiMismatchError(
                f"{name}: the driver reports parameters {got} for {launch['symbol'][:40]}..., the "
                f"manifest plans {want}. The cubin and manifest.json are from different builds: "
                "rebuild or reinstall."
            )

    def preload(self, names=None, device: int = 0) -> None:
        """Load the named variants (all by default) on ``device`` now, e.g. before graph capture."""
        rows = [self.manifest.rows[n] for n in (names or self.manifest.rows)]
        with _Context(device) as context:
            for row in rows:
                self.functions(row, device, context.id)

    # ------------------------------------------------------------------ launching
    def launch(self, row: dict, device: int, stream: int, values: dict, tensors: dict, key=None, waits=(),
               aliases=(), then=()):
        """Run ``row``'s kernels in order on ``stream`` (but those whose ``when`` value is
        0), then those of each (row, values, tensors) of ``then`` (a call of two rows, such
        as decode and its combine). ``values``: run-time sizes and scalars by name;
        ``tensors``: {"ptr", "shape", "strides", "itemsize"} by name. Every launch is
        packed before the first is issued: a call refused while packing launches nothing.
        ``key``: hashable and determining all of the above (the front doors' are the
        arrays and options of a call): the packed launches are kept under it for
        ``launch_again``. ``waits``: streams whose work so far ``stream`` waits for first
        (the producers of __cuda_array_interface__ arrays made on other streams).
        ``aliases``: (key, pinned) pairs, more keys for the same launches (an adapter's,
        computed from its own arrays; the raw API's, from its arguments' ids), each kept
        with ``pinned``, the objects it names by id, so that no other object takes their
        ids while it is kept."""
        with _Context(device) as context:
            prepared = self._prepare(row, device, context.id, stream, values, tensors, then)
            self._issue(prepared, key, waits, aliases)

    def prepare(self, row: dict, device: int, stream: int, values: dict, tensors: dict, then=()) -> "Prepared":
        """``launch``'s launches, loaded and packed but not issued (``issue`` issues them):
        what a caller that must write something first (the cache append of
        fa4_aot.torch.decode) takes once every check has passed."""
        with _Context(device) as context:
            return self._prepare(row, device, context.id, stream, values, tensors, then)

    def issue(self, prepared: "Prepared", key=None, waits=(), aliases=()) -> None:
        """Issue ``prepared``'s launches (after the streams ``waits``), kept under ``key``
        and ``aliases`` as ``launch`` keeps them."""
        if _current_id() == prepared.context:  # one driver call, as launch_again's
            self._issue(prepared, key, waits, aliases)
            return
        with _Context(prepared.device) as context:
            if context.id != prepared.context:
                raise CudaError("issue", "the context changed since the launches were prepared")
            self._issue(prepared, key, waits, aliases)

    def _prepare(self, row, device, context: int, stream: int, values, tensors, then) -> "Prepared":
        handle = cu.CUstream(stream)
        plan = []
        for one_row, one_values, one_tensors in ((row, values, tensors), *then):
            plan += self._pack(one_row, launch_values(one_row, one_values), one_tensors, device, context, handle)
        return Prepared(device, context, stream, tuple(plan))

    def _issue(self, prepared: "Prepared", key, waits, aliases) -> None:
        """Issue in the current context, which is ``prepared``'s."""
        self._wait(prepared.context, prepared.stream, waits)
        for fn, config, address, _ in prepared.plan:
            call(cu.cuLaunchKernelEx, config, fn, address, 0)
        if key is not None:
            self._keep(((key, ()), *aliases), tuple(prepared))

    def _pack(self, row: dict, values: dict, tensors: dict, device: int, context: int, stream) -> list:
        """(function, launch config, parameter address, what keeps them alive) of each of
        ``row``'s launches the call's values take."""
        plan = []
        fns = self.functions(row, device, context)
        for fn, launch in zip(fns, row["launches"]):
            if "when" in launch and not values[launch["when"]]:
                continue  # a launch the call's run-time values leave out (the varlen sort)
            buffer, pointers = pack_params(row, launch, values, tensors)
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid_of(launch, values, self.sm_count(device))
            config.blockDimX, config.blockDimY, config.blockDimZ = launch["block"]
            config.sharedMemBytes = launch["smem_bytes"]
            config.hStream = stream
            attrs = launch_attributes(launch)
            if attrs:
                config.attrs = attrs
                config.numAttrs = len(attrs)
            # the driver copies the parameters; `buffer` and `pointers` stay referenced by
            # the plan for its repeats
            plan.append((fn, config, ctypes.addressof(pointers), (pointers, buffer)))
        return plan

    def _keep(self, names, entry) -> None:
        """Keep ``entry`` (device, context, stream, launches) under each (key, pinned) of
        ``names``, dropping the least recently used past PLANS_KEPT."""
        device, context, stream, plan = entry[:4]
        with self._lock:
            for name, pinned in names:
                self._plans[name] = (device, context, stream, plan, pinned)
                self._plans.move_to_end(name)
            while len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)

    def kept(self, key) -> bool:
        """Whether launches are kept under ``key`` (a caller that writes something before
        repeating them, fa4_aot.torch's cache append, asks first)."""
        try:
            return key in self._plans
        except TypeError:
            return False

    def launch_again(self, key, waits=(), aliases=()) -> bool:
        """Repeat the launches kept under ``key`` (same kernels, parameters and stream) and
        return True; False when none are kept, or they were made in another context.
        ``waits``: as for ``launch`` (the key's stream waits for them first); ``aliases``:
        (key, pinned) pairs to keep the launches under too, as ``launch``'s."""
        try:
            entry = self._plans.get(key)
        except TypeError:  # an unhashable option: never kept, and the checks say what is wrong
            return False
        if entry is None:
            return False
        if _current_id() != entry[1]:
            # not the plan's context current: the caller's on the plan's device, or its
            # primary one, where that is the plan's (a context of the same handle made
            # since is not: it has another id)
            with _Context(entry[0]) as context:
                if context.id != entry[1]:
                    return False
                self._repeat(entry, waits)
        else:
            self._repeat(entry, waits)
        try:
            self._plans.move_to_end(key)
        except KeyError:  # dropped by another thread meanwhile
            pass
        if aliases:
            self._keep(aliases, entry)
        return True

    def _repeat(self, entry, waits) -> None:
        """Launch a kept plan in the current context (which is the plan's)."""
        if waits:
            self._wait(entry[1], entry[2], waits)
        for fn, config, address, _ in entry[3]:
            status, = cu.cuLaunchKernelEx(config, fn, address, 0)
            if status != SUCCESS:
                raise failed(cu.cuLaunchKernelEx, status)

    def _wait(self, context: int, stream: int, waits) -> None:
        """Make ``stream`` wait for the work so far on each of ``waits`` (cuEventRecord on
        the producer's stream, cuStreamWaitEvent on ours): the launch is ordered after it
        without the host waiting. One event per context serves every wait, since a wait
        takes the event's state when it is enqueued."""
        if not waits:
            return
        with self._lock:
            event = self._events.get(context)  # by context id
            if event is None:
                event = self._events[context] = call(cu.cuEventCreate,
                                                     cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            for producer in waits:
                call(cu.cuEventRecord, event, cu.CUstream(producer))
                call(cu.cuStreamWaitEvent, cu.CUstream(stream), event, 0)


def launch_attributes(launch: dict) -> list:
    """The CUlaunchAttributes of a manifest launch: its cluster shape where it has one, and
    programmatic stream serialization where it may overlap the launch before it (the
    kernel waits with griddepcontrol.wait for what that launch writes)."""
    attrs = []
    if launch["cluster"] != [1, 1, 1]:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = launch["cluster"]
        attrs.append(attr)
    if launch["programmatic"]:
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    return attrs


def launch_values(row: dict, values: dict) -> dict:
    """A call's run-time values with those the row derives from them (its ``values``:
    fa4_aot.launch.rules expressions, such as decode's piece_rows)."""
    return bind(row["values"], values) if "values" in row else values


def grid_of(launch: dict, values: dict, sm_count: int | None = None) -> tuple[int, int, int]:
    """The launch's grid: its manifest rules (fa4_aot.launch.rules expressions) over the call's
    sizes and run-time values, and ``sm_count``, the device's multiprocessors (a persistent
    kernel's grid takes at most that many CTAs: the kernel walks its items in steps of the
    grid)."""
    names = values if sm_count is None else {**values, "sm_count": sm_count}
    return tuple(evaluate(rule, names) for rule in launch["grid"])


AXIS = {"b": 0, "s": 1, "h": 2}  # of a (b, s, h, d) launch tensor


def buffer_size(slots: list[dict]) -> int:
    """Bytes of a launch's parameter buffer: its slots' end, rounded to the widest alignment."""
    end = max(s["offset"] + s["size"] for s in slots)
    align = max(s["align"] for s in slots)
    return -(-end // align) * align


def param_layout(slots: list[dict]) -> tuple[int, tuple]:
    """(buffer_size, each slot's offset) of a launch's parameter slots, reckoned once per
    launch, not per call (host time of the checked path): kept by the list's id beside the
    list itself, so that no other list takes the id while it is kept."""
    kept = _LAYOUTS.get(id(slots))
    if kept is None or kept[0] is not slots:
        if len(_LAYOUTS) >= LAYOUTS_KEPT:  # libraries loaded again and again: the old rows' go
            _LAYOUTS.clear()
        kept = _LAYOUTS[id(slots)] = (slots, (buffer_size(slots), tuple(s["offset"] for s in slots)))
    return kept[1]


_LAYOUTS: dict[int, tuple] = {}  # id(a launch's "params") -> (the list, its layout)
LAYOUTS_KEPT = 4096  # launches (the package's 388 rows have 960)


def pack_params(row: dict, launch: dict, values: dict, tensors: dict):
    """The parameter buffer (a ctypes uint8 array over a bytearray) and the array of
    per-slot pointers (ctypes uint64) cuLaunchKernelEx takes. Each slot names what fills it
    (fa4_aot/src/common/params.py writes them): "tensormap" a tensor's CUtensorMap,
    "extents" its int32 sizes over ``axes``, "ptr" its address, "stride" its element stride
    on ``axis`` (``tensors``: {"ptr", "shape", "strides", "itemsize"} of (b, s, h, d)
    tensors by name); "i32", "i64", "f32" a run-time value by name (``values``), or where
    the call gives none the slot's ``default``. Filled
    with struct.pack_into: a launch packs some 30 slots (host time per call,
    benchmarks/launch_overhead.py)."""
    slots = launch["params"]
    size, offsets = param_layout(slots)
    raw = bytearray(size)
    try:
        _fill(raw, row, slots, values, tensors)
    except KeyError:
        raise AbiMismatchError(
            f"{row['name']}: {launch['symbol'][:40]}... takes {missing_sources(launch, values, tensors)}, which "
            "this fa4_aot does not provide: the manifest is from another version; rebuild or reinstall") from None
    buffer = (ctypes.c_uint8 * len(raw)).from_buffer(raw)  # keeps `raw` alive, fixes its size
    base = ctypes.addressof(buffer)
    pointers = (ctypes.c_uint64 * len(offsets))(*[base + offset for offset in offsets])
    return buffer, pointers


def missing_sources(launch: dict, values: dict, tensors: dict) -> list[str]:
    """The tensors and values ``launch``'s slots name that a call does not give."""
    return [s.get("tensor", s.get("value")) for s in launch["params"]
            if ("tensor" in s and s["tensor"] not in tensors)
            or ("value" in s and s["value"] not in values and "default" not in s)]


def _fill(raw: bytearray, row: dict, slots: list, values: dict, tensors: dict) -> None:
    for slot in slots:
        at, kind = slot["offset"], slot["kind"]
        if kind == "tensormap":
            t, recipe = tensors[slot["tensor"]], row["tensormaps"][slot["tensor"]]
            if any(type(n) is not int for n in recipe["box"]):  # a box the call's values size
                recipe = {**recipe, "box": [evaluate(n, values) for n in recipe["box"]]}
            raw[at:at + 128] = tma.encode(recipe, t["ptr"], t["shape"], t["strides"], t["itemsize"])
        elif kind == "extents":
            shape = tensors[slot["tensor"]]["shape"]
            struct.pack_into(f"<{len(slot['axes'])}i", raw, at, *[shape[AXIS[a]] for a in slot["axes"]])
        elif kind == "ptr":
            struct.pack_into("<Q", raw, at, tensors[slot["tensor"]]["ptr"])
        elif kind == "stride":
            struct.pack_into("<q", raw, at, tensors[slot["tensor"]]["strides"][AXIS[slot["axis"]]])
        elif kind in _SCALARS:
            value = values.get(slot["value"])
            struct.pack_into(_SCALARS[kind], raw, at, slot["default"] if value is None else value)
        else:
            raise AbiMismatchError(f"{row['name']}: unknown parameter kind {kind}")


_SCALARS = {"i32": "<i", "i64": "<q", "f32": "<f"}
