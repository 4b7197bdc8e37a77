import os

# Triton kernels run on CPU only in interpreter mode, which must be set before they are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Tiny model steps run faster on one torch thread than on two contending cores (restored
    afterwards). Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2():
    from gpu.weights import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="module")
def small(smollm2):
    """SmolLM2 cut to its first 2 layers: real weights, quick steps."""
    return smollm2.truncated(2)
