"""fa4_aot: FlashAttention kernels compiled ahead of time, launched with cuda-python alone.

    import fa4_aot
    fa4_aot.forward(q, k, v, out, lse, causal=True, stream=stream_handle)

Importing fa4_aot imports neither torch nor the CuTe DSL; the torch adapter lives in
``fa4_aot.torch`` and imports torch itself.
"""

__version__ = "0.1.0"

from .decode import forward_kvcache, forward_kvcache_workspace_bytes  # noqa: E402
from .dense import backward, backward_workspace_bytes, forward, forward_workspace_bytes  # noqa: E402
from .errors import *  # noqa: E402,F401,F403
from .launch.arrays import DeviceArray  # noqa: E402
from .launch.calls import default_library, set_default_library  # noqa: E402
from .launch.loader import KernelLibrary  # noqa: E402
from .variants import Variant  # noqa: E402
from .varlen import (  # noqa: E402
    backward_varlen, backward_varlen_workspace_bytes, forward_varlen, forward_varlen_workspace_bytes,
)


def __getattr__(name: str):
    if name == "MATRIX":  # built on first use (fa4_aot.variants.matrix)
        from .variants import matrix

        return matrix()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["forward", "forward_workspace_bytes", "forward_varlen", "forward_varlen_workspace_bytes", "forward_kvcache", "forward_kvcache_workspace_bytes", "backward", "backward_varlen", "backward_workspace_bytes",
           "backward_varlen_workspace_bytes", "default_library", "set_default_library", "DeviceArray", "KernelLibrary", "MATRIX", "Variant"]
