"""Every Triton kernel compiled for real GPU targets (sm_80 A100, sm_89 L4/L40, sm_90 H100/H200) at
catalog shapes, without a GPU: the wheel's ptxas builds the cubins and cuobjdump reads their
resources (gpu.kernels.targets). A kernel that spills registers or needs more shared memory than a
target has fails here, not on the first lent GPU."""
import inspect
from pathlib import Path

import pytest

from kvsim.gpu.kernels import targets
from kvsim.gpu.kernels.targets import ARCHS, SHARED_LIMIT, Resources, compile_cases, suite_cases

KERNEL_MODULES = ("paged_attention", "quant_attention", "cache_ops", "split_kv")


def kernel_names() -> set[str]:
    import importlib
    names = set()
    for mod in KERNEL_MODULES:
        module = importlib.import_module(f"kvsim.gpu.kernels.{mod}")
        names |= {n for n, obj in inspect.getmembers(module) if n.endswith("_kernel") and hasattr(obj, "fn")}
    return names


@pytest.fixture(scope="module")
def compiled():
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton build ships no cuobjdump")
    return compile_cases(suite_cases(), ARCHS)


def test_every_kernel_is_compiled_for_every_target(compiled):
    assert kernel_names() == {r.kernel for r in compiled}, "a kernel the suite does not compile"
    for kernel in kernel_names():
        assert {r.arch for r in compiled if r.kernel == kernel} == set(ARCHS)
    shapes = {r.constants for r in compiled if r.kernel == "_paged_decode_kernel"}
    assert any("HEAD_DIM=64" in s for s in shapes) and any("HEAD_DIM=128" in s for s in shapes)
    assert any("BLOCK_SIZE=32" in s for s in shapes) and any("GROUP=1 " in s for s in shapes)


def test_no_kernel_spills_or_overflows_shared_memory(compiled):
    bad = [r for r in compiled if r.spills or not r.shared_ok]
    assert not bad, "\n".join(f"sm_{r.arch} {r.case} {r.kernel}: {r.registers} regs, stack {r.stack} B, "
                              f"local {r.local} B, shared {r.shared} B (limit {SHARED_LIMIT[r.arch]})" for r in bad)
    for r in compiled:               # and each fits at least one block per SM
        assert r.blocks_per_sm() >= 1 and 0 < r.registers <= 255


def test_decode_attention_uses_tensor_cores_over_the_padded_group(compiled):
    """The query group is padded to the 16-row MMA tile: tl.dot lowers to mma / wgmma, whose
    operands are staged in shared memory."""
    for r in compiled:
        if r.kernel in ("_paged_decode_kernel", "_mixed_decode_kernel"):
            assert "GROUP_PAD=16" in r.constants and r.shared > 0


def test_launch_specialization_follows_tritons_launcher():
    """Unit strides become constants (contiguous loads vectorize), multiples of 16 get the
    divisibility hint, tensors are pointers of their dtype."""
    import torch

    class Param:
        def __init__(self, constexpr):
            self.is_constexpr = constexpr

    class Fn:
        __name__ = "k"
        arg_names = ["x_ptr", "n", "stride_a", "stride_b", "scale", "TILE"]
        params = [Param(False)] * 5 + [Param(True)]

    sig, const, attrs, options, shape = targets._signature(
        Fn, (torch.zeros(2, dtype=torch.bfloat16), 7, 1, 4096, 0.5), {"TILE": 64, "num_warps": 4})
    assert sig == {"x_ptr": "*bf16", "n": "i32", "stride_a": "constexpr", "stride_b": "i32", "scale": "fp32",
                   "TILE": "constexpr"}
    assert const == {"stride_a": 1, "TILE": 64} and options == {"num_warps": 4} and shape == "TILE=64"
    assert attrs == {(0,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]]}


def test_occupancy_from_registers_threads_and_shared_memory():
    r = Resources("c", "k", 90, registers=128, stack=0, local=0, shared=70144, num_warps=4, constants="")
    assert r.blocks_per_sm() == 3                       # shared: 232448 // 70144
    assert Resources("c", "k", 89, 128, 0, 0, 70144, 4, "").blocks_per_sm() == 1      # 99 KiB on sm_89
    assert Resources("c", "k", 80, 255, 0, 0, 0, 4, "").blocks_per_sm() == 2          # registers: 65536 // (255 * 128)
    assert Resources("c", "k", 90, 40, 8, 0, 0, 4, "").spills


@pytest.mark.parametrize("args, message", [
    (["--gpus", "t4"], "no SM count / compile target for ['T4']"),
    (["--gpus", "nosuch"], "unknown gpu 'nosuch'"),
    (["--models", "nosuch"], "unknown model 'nosuch'"),
    (["--batches", "0"], "argument --batches: expected a whole number >= 1, got '0'"),
    (["--contexts", "-5"], "argument --contexts: expected a whole number >= 1, got '-5'"),
    (["--block-size", "7"], "argument --block-size: expected a power of two"),
])
def test_estimate_refuses_bad_options_in_one_line(args, message, capsys):
    """Unknown names were tracebacks, --batches 0 a ZeroDivisionError, and a negative context or a block
    size of 7 printed rows of nonsense; each is one usage error naming the option (exit status 2)."""
    from kvsim.gpu.kernels.estimate import main
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_targets_refuses_an_unknown_sm_version_before_compiling(capsys):
    """--arch 75 compiled every launch, then failed with a KeyError traceback."""
    from kvsim.gpu.kernels.targets import main
    with pytest.raises(SystemExit) as stop:
        main(["--arch", "75"])
    assert stop.value.code == 2 and "invalid choice: 75 (choose from 80, 86, 89, 90)" in capsys.readouterr().err
