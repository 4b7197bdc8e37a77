"""Progress over simulated work: the per-step callback of run_simulation, its figures and cancel."""
from __future__ import annotations

import pytest

from kvsim.sim.config import load_config
from kvsim.sim.io.progress import Cancelled, SimProgress, format_duration
from kvsim.sim.simulator.simulate import run_simulation

SMALL = {"trace_options.max_requests": 60, "engine.num_gpu_blocks": 400}


def test_callback_follows_the_tokens_the_engine_computes():
    calls: list[tuple[int, int, int, bool]] = []
    result = run_simulation(load_config(None, SMALL), progress=lambda p: calls.append(
        (p.tokens_done, p.steps, p.requests_done, p.finished)))
    steps = result.steps
    assert calls[-1] == (int((steps.prefill_tokens + steps.decode_tokens).sum()), len(steps), 60, True)
    assert 1 < len(calls) <= len(steps) + 1         # every step, fast-forwarded decode stretches once
    done = [c[0] for c in calls]
    assert done == sorted(done) and done[0] > 0     # moves from the first step on
    assert sum(c[2] == 0 for c in calls) > 0        # ... while no request has finished yet


def test_raising_in_the_callback_stops_the_run_at_that_step():
    seen = []

    def stop_at_step_5(p: SimProgress) -> None:
        seen.append(p.steps)
        if p.steps >= 5:
            raise Cancelled()

    with pytest.raises(Cancelled):
        run_simulation(load_config(None, SMALL), progress=stop_at_step_5)
    assert seen[-1] >= 5 and seen[-2] < 5


def test_fraction_and_eta():
    p = SimProgress(tokens_total=1000, requests_total=10, tokens_done=250)
    p.started -= 10.0                                    # 10 s for a quarter of the work
    assert p.fraction == 0.25 and p.eta_s == pytest.approx(30.0, rel=0.01)
    assert "25% of 1,000 tokens" in p.describe() and "ETA 30 s" in p.describe()
    p.tokens_done = 1500                                 # recomputation after preemption overshoots
    assert p.fraction < 1 and SimProgress(100, 1, finished=True).fraction == 1.0
    assert SimProgress(100, 1).eta_s is None
    assert format_duration(3725) == "1 h 02 min" and format_duration(75) == "1 min 15 s"


def test_enclosing_callback_reaches_simulations_run_by_other_layers():
    from kvsim.sim.io.progress import reporting_to
    from kvsim.sim.planning.sweep import RunTask, execute_run
    cfg = load_config(None, SMALL)
    calls = []
    with reporting_to(lambda p: calls.append(p.steps)):
        run_simulation(cfg)
    assert calls and calls == sorted(calls)

    def stop(p: SimProgress) -> None:
        raise Cancelled()

    with reporting_to(stop), pytest.raises(Cancelled):      # a sweep turns failures into rows, not a cancel
        execute_run(RunTask("r", cfg.model_dump(mode="json")))
    calls.clear()
    run_simulation(cfg)                                     # outside the context: no callback
    assert calls == []
