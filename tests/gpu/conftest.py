import pytest


from pathlib import Path


def _gpu_ready(kernels):
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return False, "the built cubins are sm_90a; this GPU is not"
    from fa4_aot.launch.manifest import PACKAGE_DIR

    if not ((Path(kernels) if kernels else PACKAGE_DIR) / "manifest.json").exists():
        return False, f"no built kernels in {kernels or PACKAGE_DIR}: run build_kernels.py"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ready, why = _gpu_ready(config.getoption("--kernels"))
    skip = pytest.mark.skip(reason=f"GPU tests: {why}")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not ready:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def kernel_library(request):
    """With --kernels DIR, every launch of the session (the adapters' default library)
    takes DIR's cubins; the folder, or None for the package's."""
    kernels = request.config.getoption("--kernels")
    if kernels:
        import fa4_aot
        from fa4_aot.launch.loader import KernelLibrary

        fa4_aot.set_default_library(KernelLibrary(Path(kernels)))
    return kernels


@pytest.fixture
def gen():
    """A CUDA generator with a fresh seed for each test, printed so that a failure (pytest
    shows the captured output of failed tests) can be rerun on the same inputs."""
    import random

    import torch

    seed = random.randrange(2**31)
    print(f"random inputs from seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)
