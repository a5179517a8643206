import pytest


def _gpu_ready():
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return False, "the built cubins are sm_90a; this GPU is not"
    from fa4_aot.manifest import PACKAGE_DIR

    if not (PACKAGE_DIR / "manifest.json").exists():
        return False, "no built kernels: run build_kernels.py"
    return True, ""


READY, WHY = _gpu_ready()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=f"GPU tests: {WHY}")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not READY:
                item.add_marker(skip)


@pytest.fixture
def gen():
    """A CUDA generator with a fresh seed for each test, printed so that a failure (pytest
    shows the captured output of failed tests) can be rerun on the same inputs."""
    import random

    import torch

    seed = random.randrange(2**31)
    print(f"random inputs from seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)
