"""Shared test setup: Triton's interpreter on CPU, kvsim importable from an uninstalled checkout, fixtures."""
import os

try:
    import kvsim.sim  # noqa: F401
except ImportError:       # an uninstalled checkout (`python -m pytest` from it): sim/__init__ maps kvsim here
    import sim  # noqa: F401

# Triton kernels run on CPU only in interpreter mode, which must be set before they are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import signal  # noqa: E402

import pytest  # noqa: E402

# A suite started as a background job of a script (`pytest ... &`) inherits SIGINT ignored, and so
# would every kvsim process the tests start: the Ctrl-C tests would see their signal dropped and the
# run finish with exit 0. A handler set here is reset to the default in those processes.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
    from kvsim.gpu.weights import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="module")
def small(smollm2):
    """SmolLM2 cut to its first 2 layers: real weights, quick steps."""
    return smollm2.truncated(2)


@pytest.fixture(scope="session")
def small_crosscheck(tmp_path_factory):
    """A real `kvsim crosscheck` output directory: 3 tiny requests replayed on SmolLM2 (CPU, one
    thread, CPU clock) and simulated with the cpu-2core profile (~10-20 s)."""
    torch = pytest.importorskip("torch")
    from typer.testing import CliRunner

    from kvsim.sim.cli import app
    from kvsim.traces.synthetic import synthesize

    root = tmp_path_factory.mktemp("crosscheck")
    synthesize(3, rate=5.0, prompt="uniform:8,40", output="uniform:2,5", seed=3).save(root / "tiny.jsonl")
    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(app, [
            "crosscheck", "--trace", str(root / "tiny.jsonl"), "--profile", "cpu-2core", "--num-gpu-blocks", "64",
            "--threads", "1", "--clock", "cpu", "--no-warmup", "--out", str(root / "cc")])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    return root / "cc"
