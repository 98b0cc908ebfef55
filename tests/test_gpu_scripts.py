"""The GPU round scripts' CPU dry runs: what can be checked without a GPU is checked before device time is spent."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(REPO, "benchmarks", "gpu")


def _run(args, tmp_path, timeout=600):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_ncu_summarizer_reads_ncu_csv(tmp_path):
    out = _run([os.path.join(GPU, "ncu_fwd.py"), "summarize", "--dry-run", "--out", str(tmp_path)], tmp_path)
    assert "dry run: ok" in out
    summary = json.loads((tmp_path / "ncu_summary.json").read_text())
    assert summary["total_us"]["sample.csv"] == 3980.4


def test_ncu_bwd_summarizer_splits_forward_and_backward(tmp_path):
    out = _run([os.path.join(GPU, "ncu_bwd.py"), "summarize", "--dry-run", "--out", str(tmp_path)], tmp_path)
    assert "dry run: ok" in out
    summary = json.loads((tmp_path / "ncu_bwd_summary.json").read_text())["sample_bwd.csv"]
    assert summary["fwd"]["total_us"] == 2700.0 and summary["bwd"]["total_us"] == 9268.0


def test_ncu_bwd_run_dry_run(tmp_path):
    """The profiled program's forward+backward calls on the CPU (ours, small shape, interpreter)."""
    out = _run([os.path.join(GPU, "ncu_bwd.py"), "run", "--dry-run"], tmp_path)
    assert "ncu_bwd run dry run: ok (triton, 6 gradients" in out


def test_decode_gluon_round_dry_run(tmp_path):
    """The Gluon decode round's logic on the CPU: its gate with the Triton backend standing in (must pass), and
    every sweep config's launch arguments built and mangled as the AOT signature."""
    _run([os.path.join(GPU, "decode_gluon_round.py"), "--dry-run", "--out", str(tmp_path)], tmp_path)
    res = json.loads((tmp_path / "decode_gluon.json").read_text())
    assert res["gate"]["passed"] is True and len(res["gate"]["cases"]) >= 7
