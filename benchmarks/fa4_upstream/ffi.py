"""ctypes access to FA4 upstream's kernels exported by compile.py and linked by link.sh:
open_dir(DIR), then ex(name).launcher(*args) returns a no-argument launch. Tensors are
torch tensors (their data pointer, sizes and strides fill the exported structs: every
size dynamic but the head dim, every stride but the unit one); ``stream`` a CUstream
handle as an int. A struct holds the tensor's first n sizes and first m strides, (n, m)
from spec.json (compile.py's fake tensors: every dynamic size leads, the unit stride is
last, or the page table's second)."""
import ctypes, json
from pathlib import Path

D = None
spec = lib = None


def open_dir(path):
    global D, spec, lib
    D = Path(path)
    spec = json.loads((D / "spec.json").read_text())
    lib = ctypes.CDLL(str(D / "libfa4.so"))
    return spec


_structs = {}


def struct(ns, nst):
    """The ctypes twin of an exported tensor struct with ns sizes and nst strides."""
    if (ns, nst) not in _structs:
        fields = [("data", ctypes.c_void_p)]
        if ns:
            fields.append(("shapes", ctypes.c_int32 * ns))
        if nst:
            fields.append(("strides", ctypes.c_int64 * nst))
        _structs[ns, nst] = type(f"T{ns}_{nst}", (ctypes.Structure,), {"_fields_": fields})
    return _structs[ns, nst]


def tensor_struct(t, ns, nst):
    assert t.dim() >= ns and t.dim() > nst, (tuple(t.shape), ns, nst)
    assert t.stride()[nst] == 1 or t.shape[nst] == 1, ("unit stride expected at", nst, t.stride())
    st = struct(ns, nst)
    obj = st()
    obj.data = t.data_ptr()
    if ns:
        obj.shapes = (ctypes.c_int32 * ns)(*t.shape[:ns])
    if nst:
        obj.strides = (ctypes.c_int64 * nst)(*t.stride()[:nst])
    return obj


class Export:
    def __init__(self, name):
        s = spec["exports"][name]
        self.name, self.kinds, self.tensors = name, s["args"], s["tensors"]
        self.mod = ctypes.c_void_p()
        self.libptr = ctypes.pointer(self.mod)
        ret = ctypes.c_int(0)
        init = (ctypes.c_void_p * 2)(ctypes.addressof(self.libptr), ctypes.addressof(ret))
        getattr(lib, f"_mlir_{name}_cuda_init")(init)
        assert ret.value == 0, (name, "init", ret.value)
        dev = ctypes.c_int32(0)
        load = (ctypes.c_void_p * 3)(ctypes.addressof(self.libptr), ctypes.addressof(dev), ctypes.addressof(ret))
        getattr(lib, f"_mlir_{name}_cuda_load_to_device")(load)
        assert ret.value == 0, (name, "load", ret.value)
        self.fn = getattr(lib, s["entry"])
        self.fn.argtypes, self.fn.restype = [ctypes.c_void_p, ctypes.c_int32], None

    def pack(self, *values):
        """Argument storage for one launch (kept alive by the caller)."""
        keep, ptrs = [], []
        for kind, v in zip(self.kinds, values):
            if kind.startswith("t:"):
                ns, nst = self.tensors[kind[2:]]
                obj = tensor_struct(v, ns, nst)
            elif kind == "f32":
                obj = ctypes.c_float(v)
            elif kind == "i32":
                obj = ctypes.c_int32(v)
            elif kind == "stream":
                obj = ctypes.c_void_p(v)
            keep.append(obj); ptrs.append(ctypes.addressof(obj))
        ret = ctypes.c_int32(0); keep.append(ret); ptrs.append(ctypes.addressof(ret))
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs); keep.append(arr)
        return keep, arr, ret

    def launcher(self, *values):
        keep, arr, ret = self.pack(*values)
        n = len(self.kinds) + 1
        def go():
            self.fn(arr, n)
            return ret.value
        go.keep = keep
        return go


_exports = {}
def ex(name):
    if name not in _exports:
        _exports[name] = Export(name)
    return _exports[name]


