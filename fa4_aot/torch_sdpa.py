"""torch SDPA on fa4_aot's kernels, at the import path the README gives:
``import fa4_aot.torch_sdpa`` registers the implementation (fa4_aot.torch.sdpa, where it
lives with the rest of the torch adapter)."""

from .torch.sdpa import *  # noqa: F401,F403
from .torch.sdpa import __all__  # noqa: F401
