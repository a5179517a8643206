"""Every error fa4_aot raises on purpose. Each message names the problem and the fix."""


class Fa4AotError(Exception):
    """Base of every error raised by fa4_aot."""


class InputError(Fa4AotError, ValueError):
    """An argument that no built kernel can take; raised before any launch."""


class DTypeError(InputError, TypeError):
    """Wrong element type, or q, k, v, out of different types."""


class ShapeError(InputError):
    """Wrong rank, zero or negative sizes, mismatched sizes, or sizes past index limits."""


class LayoutError(InputError):
    """A stride or pointer the kernels cannot address (last dim not contiguous, misaligned)."""


class OverlapError(LayoutError):
    """An output that shares memory with an input or another output (writing it would
    corrupt the other)."""


class DeviceError(InputError):
    """Host memory where device memory is needed, or arrays on different devices."""


class OptionError(InputError):
    """An option of the wrong type or value: a softmax_scale that is not a finite real
    number, a flag that is not a bool, an unknown q_tiles, a stream that is not a handle."""


class UnsupportedVariantError(Fa4AotError, LookupError):
    """The requested combination (head_dim, dtype, causal, arch, ...) was not built."""


class FrameworkError(Fa4AotError, RuntimeError):
    """The installed framework lacks what an adapter needs (a torch without the
    flash-attention registry or torch.library.get_kernel, for fa4_aot.torch_sdpa)."""


class ManifestError(Fa4AotError):
    """manifest.json is missing, malformed, or disagrees with the cubins beside it."""


class ChecksumError(ManifestError):
    """A cubin's sha256 differs from the manifest's: the file is corrupt or was replaced."""


class AbiMismatchError(ManifestError):
    """A kernel's parameter layout, as the driver reports it, differs from the manifest."""


class CudaError(Fa4AotError, RuntimeError):
    """A CUDA driver call failed; carries the driver's error name."""

    def __init__(self, call: str, code, message: str = ""):
        self.call = call
        self.code = code
        super().__init__(f"{call} failed: {code}{': ' + message if message else ''}")


class NoDeviceError(CudaError):
    """No CUDA driver or no GPU on this machine."""

    def __init__(self, reason: str):
        Fa4AotError.__init__(self, f"no usable CUDA device: {reason}")
        self.call, self.code = "cuInit", None


class DriverTooOldError(Fa4AotError):
    """The installed driver is older than the toolchain that built the cubins needs."""


class ArchitectureError(Fa4AotError):
    """The device cannot run the cubin's architecture (e.g. sm_90a cubins on an A100)."""
