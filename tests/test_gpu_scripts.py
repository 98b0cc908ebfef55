"""The GPU scripts on the CPU: what can be checked without a GPU is checked before device time is spent (the gate's
logic at tiny sizes, its case lists and arguments, the ncu summarizers on CSVs in ncu's layout, the eager probe's verdict)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(REPO, "benchmarks", "gpu")


def _run(args, tmp_path, timeout=600, expect=0, **extra_env):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO, **extra_env)
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_gpu_folder_holds_the_gate_the_bench_and_the_profilers():
    """At most 8 scripts, plus gate_sections/ (gate.py's section modules, one per op family); each compiles
    (Python) or parses (bash)."""
    files = sorted(f for f in os.listdir(GPU) if not f.startswith((".", "__")) and f != "gate_sections")
    assert len(files) <= 8, files
    assert {"gate.py", "common.py", "bench_production.sh"} <= set(files)
    sections = os.path.join(GPU, "gate_sections")
    files += sorted(os.path.join("gate_sections", f) for f in os.listdir(sections) if f.endswith(".py"))
    for f in files:
        path = os.path.join(GPU, f)
        if f.endswith(".py"):
            compile(open(path).read(), path, "exec")
        else:
            assert subprocess.run(["bash", "-n", path]).returncode == 0, f
    ptx = os.path.join(REPO, "benchmarks", "ptx_shared_traffic.py")
    compile(open(ptx).read(), ptx, "exec")


def test_gate_dry_run(tmp_path):
    """The gate's forward (Triton), backward and decode sections at tiny sizes under the interpreter, each in its
    child process: every case passes against its fp64 reference and gate.json records them."""
    out = _run([os.path.join(GPU, "gate.py"), "--dry-run", "--only", "fwd_triton,bwd,decode", "--out", str(tmp_path)],
               tmp_path)
    assert "ALL PASSED" in out
    res = json.loads((tmp_path / "gate.json").read_text())
    assert res["passed"] and list(res["sections"]) == ["fwd_triton", "bwd", "decode"]
    for name, sec in res["sections"].items():
        assert sec["passed"] and sec["cases"] and all(c["passed"] for c in sec["cases"]), (name, sec)
    bwd = {c["case"]: c for c in res["sections"]["bwd"]["cases"]}
    assert set(bwd["varlen triton"]["errors"]) == {"o", "final_state", "q", "k", "v", "g", "beta", "initial_state"}
    # one output in the loss: every gradient it reaches against fp64, q's (unconnected to the final state) exactly 0
    assert set(bwd["one-output o triton"]["errors"]) == {"o", "q", "k", "v", "g", "beta", "initial_state"}
    assert bwd["one-output final_state triton"]["unconnected_max_abs"] == {"q": 0.0}


def _dry_section(section, tmp_path):
    out = _run([os.path.join(GPU, "gate.py"), "--dry-run", "--only", section, "--out", str(tmp_path)], tmp_path)
    assert "ALL PASSED" in out
    res = json.loads((tmp_path / "gate.json").read_text())
    sec = res["sections"][section]
    assert res["passed"] and list(res["sections"]) == [section] and sec["passed"]
    assert sec["cases"] and all(c["passed"] for c in sec["cases"]), sec
    return {c["case"]: c for c in sec["cases"]}


def test_gate_dry_run_kda(tmp_path):
    """The kda section at tiny sizes: chunk_kda's o, final state and every gradient within the tolerance of their
    dtype against fp64 (A_log and dt_bias with the gate in the kernel against the fp64 chain of dg, and end to end); fused_recurrent_kda's serving calls (pools,
    padded rows, speculative decoding, state_v_first, the gate) against the fp64 reference."""
    cases = _dry_section("kda", tmp_path)
    grads = {"o", "final_state", "q", "k", "v", "g", "beta", "initial_state"}
    assert set(cases["chunk B1 T70 bf16"]["errors"]) == grads
    gate = cases["chunk gate softplus + beta sigmoid neg eigval fp32"]["errors"]
    chain = {"A_log (chain of dg)", "dt_bias (chain of dg)"}
    assert set(gate) == grads | chain and all(e <= 1e-3 for e in gate.values())
    params = cases["chunk gate softplus + beta sigmoid neg eigval fp32"]["gate_params"]
    assert set(params["end_to_end"]) == {"A_log", "dt_bias"} and all(e <= 1e-3 for e in params["end_to_end"].values())
    assert all(c >= 1 for c in params["cancellation"].values())
    spec = cases["decode spec T=4 state_v_first bf16 pool B=3"]
    assert spec["pad_rows_zero"] and spec["unused_slots_untouched"] and spec["slots_written"] > 0
    assert len(cases) == 10


def test_gate_dry_run_fla_options(tmp_path):
    """The fla_options section at tiny sizes: chunk_gated_delta_rule with the gate, beta sigmoid and state_v_first
    options (every gradient, A_log and dt_bias included) and the decode's state_v_first and speculative serving calls
    against fp64."""
    cases = _dry_section("fla_options", tmp_path)
    gate = cases["chunk gate varlen 1-token fp32 triton"]["errors"]
    assert set(gate) == {"o", "final_state", "q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"}
    assert all(e <= 1e-3 for e in gate.values())
    assert cases["decode spec T=4 fp32 pool B=3"]["pad_rows_zero"] and len(cases) == 8


def test_gate_dry_run_layer_ops(tmp_path):
    """The layer_ops section at tiny sizes: causal_conv1d's outputs and every gradient (fixed and varlen; with one
    output alone in the loss), its repeat calls, the decode step's live rows, pool and padded rows, rms_norm_gated's
    output and gradients against fp64, and the repeat calls of the update, the fused triple update and the norm
    (outputs and pools)."""
    cases = _dry_section("layer_ops", tmp_path)
    grads = {"y", "final_state", "dx", "dweight", "dbias", "dresidual", "dinitial_state"}
    assert set(cases["causal_conv1d fwd+bwd varlen bf16"]["errors"]) == grads
    assert all(e <= 1e-3 for e in cases["causal_conv1d fwd+bwd float32"]["errors"].values())
    assert len(cases["causal_conv1d repeat calls"]["errors"]) == 5
    assert cases["causal_conv1d_update pool bfloat16"]["padded_rows_zero"]
    assert set(cases["rms_norm_gated fwd+bwd norm_before_gate=False"]["errors"]) == {"y", "dx", "dg", "dweight",
                                                                                      "dbias"}
    for op, keys in (("update", {"y0", "pool0"}), ("update3", {"y0", "y1", "y2", "pool0", "pool1", "pool2"}),
                     ("norm", {"y0"})):
        case = cases[f"{op} repeat calls"]
        assert case["passed"] and len(case["errors"]) == 5 and all(set(e) == keys for e in case["errors"]), case
    assert set(cases["causal_conv1d fwd+bwd y alone in the loss"]["errors"]) == grads - {"final_state", "dresidual"}
    alone = cases["causal_conv1d fwd+bwd final_state alone in the loss"]
    assert alone["unconnected_max_abs"] == {"dweight": 0.0, "dbias": 0.0} and "dx" in alone["errors"]
    assert len(cases) == 13


def test_gate_case_lists_and_arguments(tmp_path):
    """--list names every section's cases (the GPU ones too: they are built without a GPU); unknown sections and
    GPU-only sections in a dry run are refused with exit 2."""
    out = _run([os.path.join(GPU, "gate.py"), "--list"], tmp_path)
    lines = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert list(lines) == ["fwd_triton", "fwd_gluon", "bwd", "decode", "matmul_triton", "matmul_gluon", "kda",
                           "layer_ops", "fla_options", "eager"]
    assert "causal_conv1d fwd+bwd varlen bf16" in lines["layer_ops"] and "CUDA graph step" in lines["layer_ops"]
    assert "chunk B2 T1000 gate softplus + beta sigmoid neg eigval bf16" in lines["kda"]
    assert "decode pool B=256 state=bfloat16" in lines["kda"] and "CUDA graph chunk fwd+bwd varlen" in lines["kda"]
    assert "gluon fwd+bwd B2 T1000 bf16 (chunks flagged pairwise)" in lines["kda"]
    assert "gluon CUDA graph chunk fwd+bwd varlen" in lines["kda"]
    assert "chunk all options no h0 B1 T8192 H16/HV32 bf16 auto" in lines["fla_options"]
    assert "decode_b1 process spread <= 5%" in lines["eager"] and "fwd_b1_t32768" in lines["eager"]
    assert "varlen_T65536_gva" in lines["fwd_triton"] and "sync_free" in lines["fwd_triton"]
    assert "gluon_hv8_B4_T8192_segments" in lines["fwd_gluon"] and "T65536_gva" in lines["fwd_gluon"]
    assert "long-T65536 gluon" in lines["bwd"] and "batch-fp16-mixed-K100-V60 gluon" not in lines["bwd"]
    assert "pool H=16 HV=32 B=256 state=bfloat16" in lines["decode"] and "CUDA graph" in lines["decode"]
    assert "x 1 configs" in lines["matmul_triton"]
    assert "nosuch" in _run([os.path.join(GPU, "gate.py"), "--only", "nosuch", "--out", str(tmp_path)], tmp_path,
                            expect=2)
    _run([os.path.join(GPU, "gate.py"), "--dry-run", "--only", "matmul_gluon", "--out", str(tmp_path)], tmp_path,
         expect=2)


def test_gate_exits_non_zero_on_a_failed_case(tmp_path, monkeypatch):
    """A section with one failed case turns the whole gate red: gate.json's passed is false and main returns 1."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(GPU)
    import gate
    monkeypatch.setattr(gate, "run_section", lambda s, out, dry: dict(
        cases=[dict(case="a", passed=True), dict(case="b", passed=False, error="x")], passed=False, section_s=0.0))
    assert gate.main(["--dry-run", "--only", "decode", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "gate.json").read_text())["passed"] is False


def test_bench_production_refuses_an_unknown_part(tmp_path):
    proc = subprocess.run(["bash", os.path.join(GPU, "bench_production.sh"), "nosuch"], capture_output=True,
                          text=True, env=dict(os.environ, OUT=str(tmp_path)), timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


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


def test_ncu_summarizer_keeps_dram_apart_from_memory_throughput():
    """ncu lists the Speed-of-Light "Memory Throughput" (the busiest memory unit) BEFORE "DRAM Throughput", and the
    Memory Workload section repeats "Memory Throughput" in byte/s: each lands in its own key, whatever the row order
    (rows as the H200's ncu writes them for a stage-2a kernel)."""
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
    """ncu_source.py on a SASS source-page CSV in ncu's layout: samples per instruction,
    per opcode, the hot region and the per-reason columns."""
    out = _run([os.path.join(GPU, "ncu_source.py"), "--dry-run", "--out", str(tmp_path)], tmp_path)
    assert "ncu_source dry run: ok" in out
    summary = json.loads((tmp_path / "ncu_source_summary.json").read_text())["sample_sass.csv"]
    assert list(summary) == ["kkt_solve_kernel", "chunk_fused_wu_ws_kernel"]     # two kernels, one file
    k = summary["chunk_fused_wu_ws_kernel"]
    assert k["top"][0]["sass"].startswith("@P0 SYNCS") and k["by_opcode"]["SYNCS"] == 0.45


def test_ncu_summarizer_reads_shared_memory_per_block_in_kb():
    """The H200's ncu writes "Dynamic Shared Memory Per Block" in "byte/block": the summary converts it to KB."""
    sys.path.insert(0, GPU)
    from ncu_fwd import summarize_csv
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
            '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')
    row = '"0","1","python3","h","kkt_solve_kernel","1","7","(128, 1, 1)","(1024, 32, 1)","0","9.0","{}","{}","{}","{}"\n'
    (k,) = summarize_csv(head + row.format("Launch Statistics", "Dynamic Shared Memory Per Block", "byte/block",
                                           "200,860"))
    assert abs(k["smem_per_block_kb"] - 200860 / 1024) < 1e-9


def test_eager_probe_summary():
    """eager_probe's per-shape verdict: the spread is slowest / fastest - 1 over the processes; a missing process
    time fails the shape, and so does a spread above --max-spread."""
    sys.path.insert(0, GPU)
    from eager_probe import summarise
    runs = [dict(eager_ms=0.26, graph_ms=0.2, host_us=270.0), dict(eager_ms=0.273, graph_ms=0.2, host_us=280.0)]
    s, failed = summarise(runs, max_spread=0.051)
    assert abs(s["spread"] - 0.05) < 1e-9 and not failed and s["host_us"] == [270.0, 280.0]
    assert summarise(runs, max_spread=0.04)[1]
    s, failed = summarise(runs + [dict(error="timeout")], max_spread=0.5)
    assert failed and s["spread"] is None
    assert summarise([], None)[1]
    # which processes met a slow host phase: their plain-Python control 1.5x the shape's fastest (a reading aid; the
    # verdict above does not use it)
    runs = [dict(eager_ms=0.17, python_speed_us=[1400.0, 1450.0]),
            dict(eager_ms=0.25, python_speed_us=[1500.0, 2800.0]),
            dict(eager_ms=0.17)]
    s, failed = summarise(runs, max_spread=0.05)
    assert failed and s["slow_host"] == [False, True, None]
