"""User mistakes end with one line naming the option or file and what was expected, exit status 2,
and no traceback; trace notices come as one `note:` line; errors never quote a file's content."""
import os
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.sim.cli import app

SIM = ["simulate", "--max-requests", "5", "-q"]


def setup_files(d: Path) -> None:
    (d / "afile").write_text("not a directory\n")
    (d / "adir").mkdir()
    (d / "slo.yaml").write_text("slo:\n  ttft: 2\n")
    (d / "spec.yaml").write_text("fixed:\n  trace_options.max_requests: 5\n")
    (d / "store").mkdir()
    (d / "importance.yaml").write_text("- 1\n- 2\n")
    (d / "huge.jsonl").write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                                  '{"timestamp": 1, "input_length": 1e23, "output_length": 5}\n')
    (d / "huge.csv").write_text("arrival_time_s,prompt_tokens,output_tokens\n0,10,5\n1,100000000000000000000000,5\n")
    (d / "early.jsonl").write_text('{"arrival_time_s": 0, "prompt_tokens": 10, "output_tokens": 5}\n'
                                   '{"arrival_time_s": -1, "prompt_tokens": 10, "output_tokens": 5}\n')
    (d / "secret.csv").write_text("API_KEY=s3cr3t-value,x\n1,2\n")
    (d / "secret.jsonl").write_text('{"s3cr3t-key": 1}\n')


# (arguments, the one line expected on stderr); {d} is the test's directory
CASES = {
    "out is a file": (SIM + ["--out", "{d}/afile"],
                      "error: --out {d}/afile: is a file; expected a directory (existing or to be created)"),
    "out under a file": (SIM + ["--out", "{d}/afile/run"],
                         "error: --out {d}/afile/run: {d}/afile is a file, so no directory can be created under it"),
    "out read-only": (SIM + ["--out", "/proc/self/kvsim-run"],
                      "error: --out /proc/self/kvsim-run: /proc/self is not writable; expected a writable directory"),
    "sweep out is a file": (["sweep", "{d}/spec.yaml", "--out", "{d}/afile", "-q"],
                            "error: --out {d}/afile: is a file; expected a directory (existing or to be created)"),
    "sweep spec is a directory": (["sweep", "{d}/adir", "--out", "{d}/s", "-q"],
                                  "error: {d}/adir: is a directory; expected a sweep spec YAML file"),
    "report out is a directory": (["report", "{d}/store", "--out", "{d}/adir"],
                                  "error: --out {d}/adir: is a directory; expected the HTML file to write, e.g. "
                                  "{d}/adir/report.html"),
    "config is a directory": (SIM + ["-c", "{d}/adir", "--out", "{d}/o"],
                              "error: --config {d}/adir: is a directory; expected a YAML config file (e.g. "
                              "{d}/adir/config.yaml)"),
    "set value not YAML": (SIM + ["--set", "engine=[1", "--out", "{d}/o"],
                           "error: --set 'engine=[1': the value is not valid YAML (expected ',' or ']', but got "
                           "'<stream end>' at line 1, column 3); expected a number, true/false, a word, [a, list] "
                           "or {{a: mapping}}"),
    "importance not a mapping": (SIM + ["--policy", "h2o", "--budget", "64", "--set",
                                        "kv.importance={d}/importance.yaml", "--out", "{d}/o"],
                                 "error: kv.importance: {d}/importance.yaml: expected a mapping (head_mix, "
                                 "head_types, ...) as in {data}/smollm2-135m.yaml, got list"),
    "prompt of 1e23 tokens (JSONL)": (SIM + ["--trace", "{d}/huge.jsonl", "--out", "{d}/o"],
                                      "error: {d}/huge.jsonl:2: input_length: expected an integer >= 1, got 1e+23 "
                                      "(above 2^53, not a count)"),
    "prompt of 1e23 tokens (CSV)": (SIM + ["--trace", "{d}/huge.csv", "--out", "{d}/o"],
                                    "error: {d}/huge.csv:3: prompt_tokens: expected an integer >= 1, got "
                                    "'100000000000000000000000' (above 2^53, not a count)"),
    "negative arrival (native JSONL)": (SIM + ["--trace", "{d}/early.jsonl", "--out", "{d}/o"],
                                        "error: {d}/early.jsonl:2: arrival_time_s: expected a time in seconds >= 0, "
                                        "got -1"),
    "SLO without unit in YAML": (SIM + ["-c", "{d}/slo.yaml", "--out", "{d}/o"],
                                 "error: {d}/slo.yaml: slo.ttft: not a duration with a unit; expected e.g. 500us, 200ms, 2s, "
                                 "10m (minutes), 1h (a bare number is ambiguous) (got 2)"),
    "unknown CSV header": (SIM + ["--trace", "{d}/secret.csv", "--out", "{d}/o"], None),
    "unknown JSON keys": (SIM + ["--trace", "{d}/secret.jsonl", "--out", "{d}/o"], None),
}


@pytest.mark.parametrize("case", CASES)
def test_user_mistake_is_one_line_naming_what_was_expected(case, tmp_path):
    setup_files(tmp_path)
    args, expected = CASES[case]
    data = Path(__file__).resolve().parents[1] / "sim" / "data" / "importance"
    args = [a.format(d=tmp_path) for a in args]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)          # numpy's cast warning was one symptom
        res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    if expected is None:                                         # never quote the file's content
        assert "s3cr3t" not in res.output and lines[0].startswith(f"error: {tmp_path}/secret.")
        assert "not a known trace format" in lines[0] or "none of the keys of a known trace" in lines[0]
    else:
        assert lines[0] == expected.format(d=tmp_path, data=data)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("leftover_filter", [None, "ignore"])
def test_trace_notices_are_one_note_line_each_not_python_warnings(tmp_path, leftover_filter):
    """Also when the process embedding kvsim (a notebook, a test worker) left an 'ignore' filter behind."""
    from kvsim.traces.errors import TraceWarning

    trace = tmp_path / "unsorted.jsonl"
    trace.write_text('{"timestamp": 5, "input_length": 10, "output_length": 5}\n'
                     '{"timestamp": 1, "input_length": 10, "output_length": 0}\n')
    with warnings.catch_warnings():
        if leftover_filter:
            warnings.simplefilter(leftover_filter, TraceWarning)
        res = CliRunner().invoke(app, SIM + ["--trace", str(trace), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines() == [
        f"note: {trace}: 1 requests have 0 output tokens (first at line 2); set to 1 because every request "
        "decodes at least one token",
        f"note: {trace}: arrivals are not sorted: 1 requests arrive before an earlier row (first at line 2); "
        "sorted by arrival time (stable)"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_out_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    res = CliRunner().invoke(app, SIM + ["--out", str(locked / "run")])
    assert res.exit_code == 2
    assert res.stderr.strip() == f"error: --out {locked}/run: {locked} is not writable; expected a writable directory"
