"""Threads of the parallel compiled LeanKV step (sim/kv/fast/compiled/threads.py): chosen from the work size and
the cores other processes leave free, and no result depends on them."""
import pytest

from kvsim.sim.kv.fast.sampled import leankv_kernel
from kvsim.sim.kv.fast.compiled.threads import CpuSample, ThreadBudget, free_cores, threads_for
from test_fast_leankv import LEANKV
from test_kv_manager import run


def test_free_cores_subtracts_only_other_processes_busy_time():
    before = CpuSample(wall=10.0, busy=100.0, own=5.0)
    # 2 s of wall on 2 cores: 3 busy CPU-seconds, 1 of them ours -> others kept one core busy
    assert free_cores(before, CpuSample(12.0, 103.0, 6.0), cores=2) == pytest.approx(1.0)
    # quiet machine: all the busy time is ours
    assert free_cores(before, CpuSample(12.0, 104.0, 9.0), cores=2) == pytest.approx(2.0)
    # a loaded machine (more busy than cores: rounding of ticks) never goes below 0 or above cores
    assert free_cores(before, CpuSample(12.0, 110.0, 5.0), cores=2) == 0.0
    assert free_cores(before, CpuSample(10.0, 100.0, 5.0), cores=2) == 2.0       # no time passed


def test_threads_serial_below_the_work_size_or_with_a_core_taken():
    assert threads_for(free=2.0, cores=2, work=10, min_work=64) == 1       # too little work to split
    assert threads_for(free=2.0, cores=2, work=512, min_work=64) == 2      # quiet machine
    assert threads_for(free=1.0, cores=2, work=512, min_work=64) == 1      # the second core busy
    assert threads_for(free=1.6, cores=2, work=512, min_work=64) == 1      # busy 40% of the time: taken
    assert threads_for(free=1.8, cores=2, work=512, min_work=64) == 2
    assert threads_for(free=0.0, cores=2, work=512, min_work=64) == 1      # never 0
    assert threads_for(free=8.0, cores=4, work=512, min_work=64) == 4      # never more than the cores


def test_thread_budget_reads_this_machine():
    budget = ThreadBudget(max_threads=64)
    assert 1 <= budget.cores <= 64
    assert budget.threads(1) == 1
    assert 1 <= budget.threads(10_000) <= budget.cores


@pytest.mark.skipif(leankv_kernel.njit is None, reason="numba absent: the step is not compiled")
def test_compiled_leankv_steps_give_the_same_run_on_any_thread_count(monkeypatch):
    cfg = {**LEANKV, "slot_strategy": "free_block", "mode": "fast"}
    runs = []
    for threads in (1, 2):
        monkeypatch.setattr(ThreadBudget, "threads", lambda self, work, n=threads: n)
        summary, steps = run(cfg, n=12, prompt=300, output=80, num_blocks=60, check=True)[:2]
        runs.append((summary, steps))
    (a, a_steps), (b, b_steps) = runs
    assert a["preemptions"] > 0                     # the pool is tight: the steps' page order matters
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]), key
    assert a_steps.equals(b_steps)
