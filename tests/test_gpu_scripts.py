"""The GPU round scripts' CPU dry runs: what can be checked without a GPU is checked before device time is spent."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(REPO, "benchmarks", "gpu")


def _run(args, tmp_path, timeout=600, **extra_env):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO, **extra_env)
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


def test_ncu_summarizer_keeps_dram_apart_from_memory_throughput():
    """ncu lists the Speed-of-Light "Memory Throughput" (the busiest memory unit) BEFORE "DRAM Throughput", and the
    Memory Workload section repeats "Memory Throughput" in byte/s: each lands in its own key, whatever the row order
    (rows as the H200's ncu wrote them for kkt_solve_kernel in round 15, r15b_ncu_fused_wu_B1_T65536.csv)."""
    sys.path.insert(0, GPU)
    from ncu_fwd import summarize_csv
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
            '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
    row = '"0","1","python3","h","kkt_solve_kernel","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","{}","{}","{}","{}"\n'
    rows = [("GPU Speed Of Light Throughput", "Memory Throughput", "%", "80.96"),
            ("GPU Speed Of Light Throughput", "DRAM Throughput", "%", "32.16"),
            ("GPU Speed Of Light Throughput", "Duration", "ns", "642,368"),
            ("Memory Workload Analysis", "Memory Throughput", "byte/s", "1,547,579,954,169.57")]
    for order in (rows, rows[::-1]):
        (k,) = summarize_csv(head + "".join(row.format(*r) for r in order))
        assert k["dram_throughput_pct"] == 32.16 and k["memory_throughput_pct"] == 80.96
        assert k["dram_bytes_per_s"] == 1547579954169.57 and abs(k["duration_us"] - 642.368) < 1e-9
        assert "_rank" not in k


def test_ncu_source_reader_dry_run(tmp_path):
    """ncu_source.py (run_round.sh ncu_src) on a SASS source-page CSV in ncu's layout: samples per instruction,
    per opcode, the hot region and the per-reason columns."""
    out = _run([os.path.join(GPU, "ncu_source.py"), "--dry-run", "--out", str(tmp_path)], tmp_path)
    assert "ncu_source dry run: ok" in out
    summary = json.loads((tmp_path / "ncu_source_summary.json").read_text())["sample_sass.csv"]
    assert list(summary) == ["kkt_solve_v2_kernel", "chunk_fused_wu_ws_kernel"]     # two kernels, one file
    k = summary["chunk_fused_wu_ws_kernel"]
    assert k["top"][0]["sass"].startswith("@P0 SYNCS") and k["by_opcode"]["SYNCS"] == 0.45


def test_ncu_summarizer_reads_shared_memory_per_block_in_kb():
    """The H200's ncu writes "Dynamic Shared Memory Per Block" in "byte/block"; until round 16 the summary kept the
    bytes under smem_per_block_kb (16384.0 for kkt_solve_v2_kernel's 16 KB). Rows as in r16c_ncu_gluon_kkt_v2."""
    sys.path.insert(0, GPU)
    from ncu_fwd import summarize_csv
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
            '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
    row = '"0","1","python3","h","kkt_solve_v2_kernel","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","{}","{}","{}","{}"\n'
    (k,) = summarize_csv(head + row.format("Launch Statistics", "Dynamic Shared Memory Per Block", "byte/block",
                                           "200,860"))
    assert abs(k["smem_per_block_kb"] - 200860 / 1024) < 1e-9


def test_segments_round_dry_run(tmp_path):
    """The segments round's logic on the CPU (the fused kernel's schedule model, 4 segments of 3 chunks): every row
    runs; slow decay sends both heads unsegmented (o and final equal to the unsegmented forward's), mixed one of two,
    fast none; at fast decay o within 3e-4 of the unsegmented forward (the warm-up in the fused kernel rounds as the
    chain does: next to equal, 0 where the truncation stays below bf16's rounding)."""
    _run([os.path.join(GPU, "segments_round.py"), "--dry", "--out", str(tmp_path)], tmp_path)
    rows = {r["decay"]: r for r in json.loads((tmp_path / "segments_round.json").read_text())["rows"]}
    assert all("error" not in r and r["finite"] for r in rows.values()), rows
    assert [rows[d]["unsegmented_pairs"] for d in ("fast", "mixed", "slow")] == [0, 1, 2]
    assert rows["slow"]["o_vs_unsegmented"] == 0 and rows["slow"]["final_vs_unsegmented"] == 0
    assert rows["fast"]["o_vs_unsegmented"] < 3e-4


def test_segments_round_gf_dry_run(tmp_path):
    """SEG_KIND=gf: the gate-free kernel's segment launch (its schedule model) next to the W/U kernel's model for the
    unsegmented pairs: every row runs and passes its fp64 check; slow decay sends both heads to the W/U launch (o and
    final equal to the unsegmented forward's, which runs the W/U model too), mixed one of two, fast none."""
    _run([os.path.join(GPU, "segments_round.py"), "--dry", "--out", str(tmp_path)], tmp_path, SEG_KIND="gf")
    rows = {r["decay"]: r for r in json.loads((tmp_path / "segments_gf_round.json").read_text())["rows"]}
    assert all("error" not in r and r["finite"] and r["passed"] and r["kind"] == "gf" for r in rows.values()), rows
    assert [rows[d]["unsegmented_pairs"] for d in ("fast", "mixed", "slow")] == [0, 1, 2]
    assert rows["slow"]["o_vs_unsegmented"] == 0 and rows["slow"]["final_vs_unsegmented"] == 0
    assert all(rows[d]["err_o_vs_fp64"] < rows[d]["tol"] for d in rows)


def test_segments_timeline_summary():
    """segments_round.calls_timeline on a chrome trace of three calls (kkt, a memset, two kernels on two streams; one
    call cut short, one host event): the short call and non-GPU events are dropped, offsets and durations are the
    medians over the complete calls, the span runs from the call's first start to its last end."""
    sys.path.insert(0, GPU)
    try:
        from segments_round import calls_timeline
    finally:
        sys.path.remove(GPU)
    ev = []
    for i, (t0, d) in enumerate(((0, 10), (1000, 12), (2000, 14))):
        ev += [dict(cat="kernel", name="kkt_solve_v3_kernel", ts=t0, dur=100, tid=7),
               dict(cat="gpu_memset", name="Memset", ts=t0 + 101, dur=2, tid=7),
               dict(cat="kernel", name="segment_window_kernel", ts=t0 + 105, dur=d, tid=7),
               dict(cat="kernel", name="chunk_fused_wu_ws_kernel", ts=t0 + 120 + i, dur=500, tid=9),
               dict(cat="cpu_op", name="aten::empty", ts=t0 + 50, dur=1, tid=1)]
    ev += [dict(cat="kernel", name="kkt_solve_v3_kernel", ts=3000, dur=100, tid=7)]
    r = calls_timeline(ev)
    assert r["calls"] == 3 and [k["name"] for k in r["kernels"]] == [
        "kkt_solve_v3_kernel", "Memset", "segment_window_kernel", "chunk_fused_wu_ws_kernel"]
    assert [k["start_us"] for k in r["kernels"]] == [0, 101, 105, 121]
    assert [k["dur_us"] for k in r["kernels"]] == [100, 2, 12, 500] and r["kernels"][3]["stream"] == 9
    assert r["span_us"] == 621
    assert "error" in calls_timeline([dict(cat="kernel", name="other", ts=0, dur=1)])


def test_run_round_refuses_a_snapshot_of_another_commit(tmp_path):
    """A snapshot made by snap.sh carries SNAP_COMMIT: run_round.sh takes it as LINATTN_COMMIT, and refuses (exit 2,
    no step run) a LINATTN_COMMIT that names another commit (round 18 lost a device call to a stale snapshot)."""
    script = os.path.join(GPU, "run_round.sh")
    (tmp_path / "SNAP_COMMIT").write_text("abc1234\n")
    env = dict(os.environ, OUT=str(tmp_path / "out"), LINATTN_COMMIT="def5678", LINATTN_BENCH_CACHE=str(tmp_path / "c"))
    proc = subprocess.run(["bash", script, "nosuchstep"], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                          timeout=120)
    assert proc.returncode == 2 and "this snapshot is of abc1234" in proc.stderr
    assert "=== nosuchstep" not in proc.stdout
    env["LINATTN_COMMIT"] = "abc1234"
    proc = subprocess.run(["bash", script, "nosuchstep"], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                          timeout=120)
    assert "=== nosuchstep" in proc.stdout and "snapshot is of" not in proc.stderr


def test_host_profile_dry_run(tmp_path):
    """host_profile.py on the CPU (one tiny Triton-backend row): host us per call, the profile's total, and both
    top lists, each entry a function name with a positive time per call."""
    _run([os.path.join(GPU, "host_profile.py"), "--dry", "--out", str(tmp_path)], tmp_path)
    (r,) = json.loads((tmp_path / "host_profile.json").read_text())["rows"]
    assert "error" not in r and r["host_us"] > 0 and r["profiled_us"] > 0, r
    for key in ("by_own_time", "by_cumulative"):
        assert r[key] and all(e["us"] >= 0 and ":" in e["fn"] for e in r[key]), r[key]
    assert r["by_cumulative"][0]["us"] >= r["by_cumulative"][-1]["us"]
