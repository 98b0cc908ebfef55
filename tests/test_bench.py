"""`linattn bench`, `verify` and `doctor` on the CPU (Triton under TRITON_INTERPRET=1 when CI sets it)."""
import importlib.util
import json
import math
import os

import pytest
import torch

from linattn.backends import op_backends
from linattn.cli import main

OP = "chunk_gated_delta_rule"


def _tiny_backend() -> str:
    """The triton backend once it exists and runs here (interpreter), else the reference."""
    from linattn.bench.ops import _ensure_gdn_registered
    _ensure_gdn_registered()
    table = op_backends(OP)
    if "triton" in table.names() and os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "reference"


def test_bench_times_each_backend_in_fresh_processes(tmp_path, monkeypatch, capsys):
    """2 rounds x 1 backend on one tiny row: two child processes (not this one), alternated rounds, each with its
    environment, ceilings and eager times; the row's median and spread are those of the processes' medians; the
    first round checks the anchor against the reference; on the CPU the graph column is n/a with its reason."""
    from linattn.bench import presets
    monkeypatch.setitem(presets.PRESETS, "tiny", presets.PRESETS["tiny"][:1])   # the children get shapes by job
    backend = _tiny_backend()
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    rc = main(["bench", "--preset", "tiny", "--backends", backend, "--modes", "fwd", "--procs", "2", "--repeats", "1",
               "--warmup", "0", "--no-cold", "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["schema"] == "linattn-bench/2" and res["procs"] == 2 and res["backends"] == [backend]
    procs = res["processes"]
    assert [(p["round"], p["backend"], p["status"]) for p in procs] == [(0, backend, "ok"), (1, backend, "ok")]
    assert len({p["pid"] for p in procs} | {os.getpid()}) == 3
    here = os.path.dirname(os.path.abspath(__import__("linattn").__file__))
    assert all(p["linattn"] == here for p in procs)              # the children timed this tree
    assert res["env"]["torch"] == torch.__version__ and res["env_line"] == procs[0]["env_line"]
    assert all(p["env"]["triton_interpret"] == os.environ.get("TRITON_INTERPRET", "0") for p in procs)
    per = [p["rows"][0]["eager"]["median_ms"] for p in procs]
    assert all(p["rows"][0]["eager"]["repeats"] == 1 and p["rows"][0]["eager"]["times_ms"] == [per[i]]
               for i, p in enumerate(procs))
    (row,) = res["rows"]
    assert row["status"] == "ok" and row["rounds"] == [0, 1]
    eager = row["eager"]
    assert eager["per_process_ms"] == per and eager["median_ms"] == pytest.approx((per[0] + per[1]) / 2)
    assert eager["spread"] == pytest.approx((max(per) - min(per)) / min(per))
    assert eager["timing"] == "eager, host clock (cpu)" and eager["ratios"] == {}
    for key in ("tflops", "gbps", "pct_of_floor"):
        assert math.isfinite(eager[key]) and eager[key] > 0, key
    assert row["graph"] == {"status": "n/a", "reason": "no CUDA device"}
    assert res["ceilings"]["matmul_tflops"] == pytest.approx(
        sorted(p["ceilings"]["matmul_tflops"] for p in procs)[0] / 2 + sorted(
            p["ceilings"]["matmul_tflops"] for p in procs)[1] / 2)
    # checks in round 0 only: the anchor against the reference (or it is the reference)
    assert "compared_to" in procs[0]["rows"][0] and "compared_to" not in procs[1]["rows"][0]
    want = "is the reference" if backend == "reference" else "pass"
    assert row["compared_to"] == "reference" and row["reference_check"]["status"] == want
    text = capsys.readouterr().out
    assert "eager ms" in text and "graph n/a for" in text and "median over 2 fresh processes" in text
    mdtext = md.read_text()
    assert f"| shape | {backend} ms |" in mdtext and "fwd, eager:" in mdtext and res["env_line"] in mdtext
    assert "CUDA graph:" not in mdtext                        # no table for a column that ran nowhere


def test_child_compares_every_backend_with_the_anchor(tmp_path):
    """The check round in-process (linattn.bench.child.run_job, as the children call it), fwd+bwd on the varlen
    tiny row (a 1-token sequence): the first backend that runs is the anchor (saved, checked against the
    reference); a later backend is compared on o, the final state and every gradient; a wrong output shows; SDPA is
    not compared and skips varlen; unknown and missing backends are skipped with their reasons."""
    from linattn.bench.child import run_job
    from linattn.bench.ops import _ensure_gdn_registered
    from linattn.bench.presets import get_preset
    from linattn.ops.gated_delta_rule.reference import chunk_gated_delta_rule as ref

    def broken(*args, **kwargs):
        o, s = ref(*args, **kwargs)
        o = o.clone()
        o[:, -1] += 1.0
        return o, s

    _ensure_gdn_registered()
    table = op_backends(OP)
    table.register("ref_copy", ref, lambda *a, **k: (True, ""), priority=1000, auto=False)
    table.register("broken", broken, lambda *a, **k: (True, ""), priority=1001, auto=False)
    shapes = get_preset("tiny")[1:]
    assert shapes[0]["lengths"][0] == 1
    rows = {}
    try:
        for b in ("ref_copy", "broken", "sdpa", "nosuch", "fla"):
            res = run_job(dict(op="gated_delta_rule", backend=b, shapes=shapes, modes=["fwdbwd"], device="cpu",
                               repeats=1, warmup=0, round=0, compare_dir=str(tmp_path), graph=b != "broken"))
            (rows[b],) = res["rows"]
    finally:
        table.unregister("ref_copy")
        table.unregister("broken")
    grads = {"dq", "dk", "dv", "dg", "dbeta", "dh0"}
    anchor = rows["ref_copy"]
    assert anchor["status"] == "ok" and anchor["compared_to"] == "reference"
    assert anchor["reference_check"]["status"] == "pass" and set(anchor["errors"]) == {"o", "final_state"} | grads
    b = rows["broken"]
    assert b["status"] == "ok" and b["compared_to"] == "ref_copy" and set(b["errors"]) == {"o", "final_state"} | grads
    assert b["errors"]["o"] > 1e-2 and all(b["errors"][n] == 0.0 for n in {"final_state"} | grads)
    assert rows["sdpa"]["status"] == "skipped" and "varlen" in rows["sdpa"]["reason"]
    assert rows["nosuch"]["status"] == "skipped" and "not registered" in rows["nosuch"]["reason"]
    fla = rows["fla"]
    if importlib.util.find_spec("fla") is None:
        assert fla["status"] == "skipped" and "fla not importable" in fla["reason"]
    for r in (anchor, b):
        assert r["eager"]["status"] == "ok" and r["grads"] == "verified"
    assert anchor["graph"] == {"status": "n/a", "reason": "no CUDA device"}
    assert b["graph"] == {"status": "n/a", "reason": "not asked for (--no-graph)"}


def test_run_child_records_a_process_that_dies(tmp_path):
    """A child that exits with an error leaves a record with the reason and its last stderr lines, and no rows."""
    from linattn.bench.runner import run_child
    p = run_child(dict(op="nosuch_op", backend="triton", shapes=[], modes=["fwd"], device="cpu", repeats=1,
                       warmup=0, round=1, compare_dir=None))
    assert p["status"] == "error" and p["rows"] == [] and p["round"] == 1 and p["backend"] == "triton"
    assert p["reason"] == "exit status 1" and any("nosuch_op" in line for line in p["stderr_tail"])


def test_run_child_imports_the_parents_linattn_from_any_directory(tmp_path, monkeypatch):
    """Started in a folder that holds another linattn (another checkout's), the child still imports the tree this
    process imported: `python -m` puts the working directory ahead of PYTHONPATH, so the child runs in that tree."""
    from linattn.bench.runner import run_child
    fake = tmp_path / "linattn"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('imported the working directory\'s linattn')\n")
    monkeypatch.chdir(tmp_path)
    p = run_child(dict(op="nosuch_op", backend="triton", shapes=[], modes=["fwd"], device="cpu", repeats=1,
                       warmup=0, round=1, compare_dir=None))
    assert any("nosuch_op" in line for line in p["stderr_tail"]), p["stderr_tail"]
    assert not any("working directory" in line for line in p["stderr_tail"]), p["stderr_tail"]


def _proc(backend, rnd, rows, ceil=None):
    return dict(backend=backend, round=rnd, rows=rows, ceilings=ceil)


def _prow(key, eager, graph=None, status="ok", **extra):
    r = dict(dict(key=key, shape_label=f"S{key}", mode="fwd", status=status, family="linattn", notes=[]), **extra)
    if status == "ok":
        r["first_call_s"] = 1.0
        r["eager"] = dict(status="ok", median_ms=eager, timing="eager, cuda events", repeats=5, input_sets=2)
        r["graph"] = (dict(status="ok", median_ms=graph, timing="cuda graph replay", repeats=5, input_sets=2)
                      if graph is not None else dict(status="n/a", reason="capture failed: X"))
    return r


def test_aggregate_median_spread_and_ratios():
    """Synthetic per-process numbers against hand-computed medians, spreads and ratios."""
    from linattn.bench.aggregate import aggregate, median_ceilings, spread
    c = lambda t: dict(matmul_tflops=t, copy_gbps=10 * t, matmul_ms=1.0, copy_ms=2.0, how="h")  # noqa: E731
    procs = [
        _proc("triton", 0, [_prow("0-fwd", 1.0, 0.5, compared_to="reference", errors={"o": 1e-3}),
                            _prow("1-fwd", 3.0, 2.0)], c(10.0)),
        _proc("fla", 0, [_prow("0-fwd", 2.0, family="peer", compared_to="triton", errors={"o": 2e-3}),
                         _prow("1-fwd", 5.0, 4.0)], c(30.0)),
        _proc("sdpa", 0, [_prow("0-fwd", 4.0, 1.0), _prow("1-fwd", None, status="skipped", reason="varlen")], c(20.0)),
        _proc("triton", 1, [_prow("0-fwd", 1.2, 0.5), _prow("1-fwd", 3.0, 2.5)], c(25.0)),
        _proc("fla", 1, [_prow("0-fwd", 2.4), _prow("1-fwd", 6.0, 4.0)], c(15.0)),
        _proc("sdpa", 1, [_prow("0-fwd", None, status="error", reason="OOM"),
                          _prow("1-fwd", None, status="skipped", reason="varlen")], c(35.0)),
        _proc("triton", 2, [_prow("0-fwd", 1.1, 0.55), _prow("1-fwd", 3.3, 2.0)], c(5.0)),
        _proc("fla", 2, [], None),                                  # the process died: no rows, no ceilings
        _proc("sdpa", 2, [_prow("0-fwd", 8.0, 3.0), _prow("1-fwd", None, status="skipped", reason="varlen")], c(40.0)),
    ]
    assert spread([2.0, 3.0, 2.5]) == pytest.approx(0.5)
    ceil = median_ceilings(procs)
    assert ceil["matmul_tflops"] == 22.5 and ceil["copy_gbps"] == 225.0 and len(ceil["per_process"]) == 8
    rows = aggregate(procs, ["triton", "fla", "sdpa"], peers=("fla", "flashqla", "sdpa"))
    got = {(r["key"], r["backend"]): r for r in rows}
    assert [(r["key"], r["backend"]) for r in rows] == [("0-fwd", "triton"), ("0-fwd", "fla"), ("0-fwd", "sdpa"),
                                                         ("1-fwd", "triton"), ("1-fwd", "fla"), ("1-fwd", "sdpa")]
    t0 = got[("0-fwd", "triton")]
    assert t0["eager"]["per_process_ms"] == [1.0, 1.2, 1.1] and t0["eager"]["median_ms"] == 1.1
    assert t0["eager"]["spread"] == pytest.approx(0.2) and t0["graph"]["median_ms"] == 0.5
    assert t0["graph"]["spread"] == pytest.approx(0.1)
    assert t0["compared_to"] == "reference" and t0["errors"] == {"o": 1e-3} and t0["rounds"] == [0, 1, 2]
    f0 = got[("0-fwd", "fla")]                   # rounds 0 and 1 only: the round-2 process died
    assert f0["eager"]["per_process_ms"] == [2.0, 2.4] and f0["eager"]["median_ms"] == pytest.approx(2.2)
    assert f0["eager"]["spread"] == pytest.approx(0.2) and f0["rounds"] == [0, 1]
    assert f0["graph"] == {"status": "n/a", "reason": "capture failed: X"} and f0["family"] == "peer"
    s0 = got[("0-fwd", "sdpa")]                  # an error in round 1: the other rounds' numbers, and the failure
    assert s0["status"] == "ok" and s0["eager"]["median_ms"] == 6.0 and s0["eager"]["spread"] == 1.0
    assert s0["failed_in"] == ["round 1: error: OOM"] and s0["graph"]["median_ms"] == 2.0
    assert t0["eager"]["ratios"] == {"fla": pytest.approx(2.0), "sdpa": pytest.approx(6.0 / 1.1)}
    assert t0["graph"]["ratios"] == {"sdpa": pytest.approx(4.0)}          # fla has no graph column
    assert f0["eager"]["ratios"] == {"sdpa": pytest.approx(6.0 / 2.2)}   # a peer's ratios against the other peers
    t1 = got[("1-fwd", "triton")]
    assert t1["eager"]["median_ms"] == 3.0 and t1["eager"]["spread"] == pytest.approx(0.1)
    assert t1["graph"]["median_ms"] == 2.0 and t1["graph"]["spread"] == pytest.approx(0.25)
    assert t1["eager"]["ratios"] == {"fla": pytest.approx(5.5 / 3.0)} and t1["graph"]["ratios"] == {"fla": 2.0}
    s1 = got[("1-fwd", "sdpa")]
    assert s1["status"] == "skipped" and s1["reason"] == "varlen" and "eager" not in s1


def test_bench_refuses_gpu_presets_on_cpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["bench", "--preset", "production", "--backends", "reference"]) == 2
    assert "only the tiny preset" in capsys.readouterr().err


def test_doctor_without_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "GPU: none" in out
    assert f"triton {__import__('triton').__version__}" in out
    assert "fla:" in out and "flash_qla:" in out and "Gluon" in out
    assert f"op {OP}:" in out and "auto picks" in out
    assert "reference" in out and "only when requested by name" in out
    # the decode op has no bench entry: doctor shows its serving calls, and why the Gluon decode is not taken here
    for label in ("decode step, batch 256, float32 pool", "decode step, batch 256, bfloat16 pool",
                  "decode step, batch 1, float32 pool"):
        assert f"op fused_recurrent_gated_delta_rule: {label}" in out
    assert "the Gluon decode needs an sm_90 GPU" in out or "the interpreter cannot run Gluon kernels" in out


def test_verify_refuses_speed_when_gate_fails(capsys):
    from linattn.ops.gated_delta_rule.reference import chunk_gated_delta_rule as ref

    def broken(*args, **kwargs):
        o, s = ref(*args, **kwargs)
        o = o.clone()
        o[:, -1] += 1.0                   # wrong last token: a plausible off-by-one in a kernel
        return o, s

    table = op_backends(OP)
    table.register("broken", broken, lambda *a, **k: (True, ""), priority=1000, auto=False)
    try:
        rc = main(["verify", "--backend", "broken", "--modes", "fwd", "--peers", "sdpa"])
    finally:
        table.unregister("broken")
    out = capsys.readouterr().out
    assert rc == 1
    assert "GATE RED" in out and "FAIL" in out
    assert "speedup" not in out and "eager ms" not in out and "[bench]" not in out


def test_verify_green_gate_then_benches(capsys):
    rc = main(["verify", "--backend", "reference", "--modes", "fwd", "--peers", "sdpa", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "gate green" in out and "FAIL" not in out
    assert "eager ms" in out and "sdpa" in out


def test_cold_only_keeps_the_child_caches_for_the_bench(tmp_path, monkeypatch):
    """--cold-only: the fresh-process first call runs with new empty cache folders, then what it compiled is
    merged into this process's cache folders (named by the same variables), so a later bench call on the same
    machine does not compile it again; no timed rows are produced."""
    from linattn.bench.timing import CACHE_VARS
    mine = {var: tmp_path / "mine" / var.lower() for var in CACHE_VARS}
    for var, d in mine.items():
        monkeypatch.setenv(var, str(d))
    # something already in our Triton cache must survive the merge
    (mine["TRITON_CACHE_DIR"] / "old").mkdir(parents=True)
    (mine["TRITON_CACHE_DIR"] / "old" / "x.json").write_text("{}")
    backend = _tiny_backend()
    out = tmp_path / "cold.json"
    rc = main(["bench", "--preset", "tiny", "--backends", backend, "--modes", "fwd", "--cold-only",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["rows"] == []
    (cold,) = res["cold"]
    assert cold["status"] == "ok", cold
    assert cold["backend"] == backend and cold["mode"] == "fwd"
    assert cold["first_call_s"] > 0 and cold["second_call_s"] > 0 and cold["process_s"] >= cold["first_call_s"]
    assert (mine["TRITON_CACHE_DIR"] / "old" / "x.json").exists()
    # whatever the child wrote into its fresh folders (the interpreter compiles no Triton kernel; a GPU run
    # fills the Triton cache) is now in ours
    assert set(cold["caches_kept_for_bench"]) <= set(CACHE_VARS)
    for var in cold["caches_kept_for_bench"]:
        assert mine[var].is_dir()


def test_keep_caches_merges_folders(tmp_path, monkeypatch):
    from linattn.bench import timing
    child = tmp_path / "child"
    (child / "triton_cache_dir" / "abc").mkdir(parents=True)
    (child / "triton_cache_dir" / "abc" / "k.cubin").write_bytes(b"\x01\x02")
    dst = tmp_path / "dst"
    (dst / "old").mkdir(parents=True)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(dst))
    monkeypatch.delenv("TILELANG_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert timing._keep_caches(str(child)) == ["TRITON_CACHE_DIR"]
    assert (dst / "abc" / "k.cubin").read_bytes() == b"\x01\x02" and (dst / "old").is_dir()


def _fake_part(rows, cold=(), partial=False):
    """A result file of one round: its rows aggregated (ratios against the peers computed in the part)."""
    from linattn.bench.aggregate import aggregate
    from linattn.bench.report import SCHEMA
    order = list(dict.fromkeys(r[2] for r in rows))
    procs = {}
    for shape, mode, backend, ms, *status in rows:
        st = status[0] if status else "ok"
        procs.setdefault(backend, _proc(backend, 0, []))["rows"].append(
            dict(_prow(shape, ms, ms / 2, status=st, reason="why" if st != "ok" else None), shape_label=shape,
                 mode=mode))
    d = dict(schema=SCHEMA, op="gated_delta_rule", preset="p", env_line="env", ceilings={}, procs=1, repeats=5,
             backends=order, peers=[b for b in order if b in ("fla", "sdpa")], modes=["fwd"],
             rows=aggregate(list(procs.values()), order, ("fla", "sdpa")), processes=list(procs.values()),
             cold=[dict(backend=b, mode=m, status="ok", first_call_s=s, second_call_s=0.001, process_s=s + 1)
                   for b, m, s in cold])
    if partial:
        d["partial"] = True
    return d


def test_merge_takes_each_shape_mode_whole_from_one_part(tmp_path):
    """A part cut short plus an earlier full run: each (shape, mode) comes from the part with more rows that ran
    (the first file on a tie) with the ratios of that part, cold entries deduplicated, processes kept per part;
    results of the earlier single-process bench are refused."""
    from linattn.bench.report import format_table, load_results, markdown
    new = _fake_part([("A", "fwd", "triton", 1.0), ("A", "fwd", "gluon", 0.8), ("A", "fwd", "fla", 2.0),
                      ("B", "fwd", "triton", 3.0), ("B", "fwd", "fla", 6.0),
                      ("C", "fwd", "triton", 5.0)], cold=[("triton", "fwd", 9.0)], partial=True)
    old = _fake_part([("A", "fwd", "triton", 1.1), ("A", "fwd", "fla", 2.2),
                      ("B", "fwd", "triton", 3.3), ("B", "fwd", "fla", 6.6),
                      ("C", "fwd", "triton", 5.5), ("C", "fwd", "fla", 11.0), ("C", "fwd", "sdpa", 1.0, "skipped")],
                     cold=[("triton", "fwd", 99.0), ("triton", "fwdbwd", 20.0)])
    paths = []
    for name, d in (("new.json", new), ("old.json", old)):
        paths.append(str(tmp_path / name))
        with open(paths[-1], "w") as f:
            json.dump(d, f)
    m = load_results(paths)
    got = {(r["shape_label"], r["backend"]): (r["part"], r["eager"]["median_ms"], r["eager"]["ratios"].get("fla"))
           for r in m["rows"] if r["status"] == "ok"}
    assert got[("A", "gluon")] == (0, 0.8, 2.5) and got[("A", "triton")][0] == 0      # more rows ran in part 0
    assert got[("B", "triton")] == (0, 3.0, 2.0)                                        # tie: the first file
    assert got[("C", "triton")] == (1, 5.5, 2.0)                                        # part 1 ran C with fla
    assert sum(1 for r in m["rows"] if r["shape_label"] == "C") == 3                    # part 0's C row dropped
    assert [(c["backend"], c["mode"], c["first_call_s"], c["part"]) for c in m["cold"]] == \
        [("triton", "fwd", 9.0, 0), ("triton", "fwdbwd", 20.0, 1)]
    assert m["parts"][0]["partial"] and m["parts"][0]["rows_taken"] == 5 and m["parts"][1]["rows_taken"] == 3
    assert sorted((p["part"], p["backend"]) for p in m["processes"]) == \
        [(0, "fla"), (0, "gluon"), (0, "triton"), (1, "fla"), (1, "sdpa"), (1, "triton")]
    table = format_table(m)
    assert "cut short" in table and "[part 1]" in table and "vs fla e/g" in table
    md = markdown(m)
    assert "| shape | triton ms | gluon ms | fla ms | triton vs fla | gluon vs fla |" in md
    assert "| A | 1 (0.0%) | 0.8 (0.0%) | 2 (0.0%) | 2.00x | 2.50x |" in md
    assert "| C | 5.5 (0.0%) | - | 11 (0.0%) | 2.00x | - |" in md
    old_schema = tmp_path / "schema1.json"
    old_schema.write_text(json.dumps(dict(old, schema="linattn-bench/1")))
    with pytest.raises(ValueError, match="earlier bench"):
        load_results([paths[0], str(old_schema)])


def test_bench_kda_checks_triton_against_the_reference_and_names_fla(tmp_path, capsys):
    """`--op kda` (chunk_kda): its presets and defaults, the roofline counts with the K-wide gate, and one check round
    in-process on kda_tiny's varlen row (a 1-token sequence), forward + backward: triton is the anchor, checked
    against the reference backend on o, the final state and every gradient; FLA's chunk_kda is the peer (skipped with
    the reason where fla is not installed); SDPA is refused by name."""
    from linattn.bench.child import run_job
    from linattn.bench.ops import BENCH_OPS, get_bench_op
    from linattn.bench.presets import CPU_PRESETS, get_preset
    op = get_bench_op("kda")
    assert BENCH_OPS["chunk_kda"] is op and op.registry_op == "chunk_kda" and "kda_tiny" in CPU_PRESETS
    assert op.default_presets == ("kda_production", "kda_tiny")
    prod = get_preset("kda_production")
    assert [(s["B"], s["T"]) for s in prod] == [(1, 32768), (8, 4096), (4, 16384)]
    assert all((s["H"], s["HV"], s["K"], s["V"]) == (32, 32, 128, 128) for s in prod)
    s = prod[0]
    gdn = get_bench_op("gated_delta_rule")
    assert op.flops(s, "fwd") == gdn.flops(s, "fwd") and op.flops(s, "fwdbwd") == 3.5 * op.flops(s, "fwd")
    wide = s["B"] * s["T"] * s["HV"] * (s["K"] - 1) * 4            # g's extra K - 1 fp32 values per token and head
    assert op.bytes(s, "fwd") == gdn.bytes(s, "fwd") + wide
    assert op.bytes(s, "fwdbwd") == gdn.bytes(s, "fwdbwd") + 3 * wide
    shapes = get_preset("kda_tiny")[1:]
    assert shapes[0]["lengths"][0] == 1
    backend = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    rows = {}
    for b in (backend, "fla", "sdpa"):
        res = run_job(dict(op="kda", backend=b, shapes=shapes, modes=["fwdbwd"], device="cpu", repeats=1, warmup=0,
                           round=0, compare_dir=str(tmp_path)))
        (rows[b],) = res["rows"]
    mine = rows[backend]
    assert mine["status"] == "ok" and mine["compared_to"] == "reference" and mine["grads"] == "verified"
    want = "is the reference" if backend == "reference" else "pass"
    assert mine["reference_check"]["status"] == want
    if backend != "reference":
        assert set(mine["errors"]) == {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
        assert all(0 < e <= 1.5e-2 for e in mine["errors"].values()), mine["errors"]
    if importlib.util.find_spec("fla") is None:
        assert rows["fla"]["status"] == "skipped" and "fla not importable" in rows["fla"]["reason"]
    assert rows["sdpa"]["status"] == "skipped" and "no KDA op" in rows["sdpa"]["reason"]
    assert main(["bench", "--op", "kda", "--preset", "kda_production", "--device", "cpu"]) == 2
    assert "only the kda_tiny preset" in capsys.readouterr().err


def test_every_bench_op_documents_its_models():
    """The runner writes each op's FLOP model (its docstring) and byte model into every result: an op registered
    with an undocumented FLOP function (a lambda) failed only when a GPU run wrote its JSON."""
    from linattn.bench.ops import BENCH_OPS
    for name, op in BENCH_OPS.items():
        assert (op.flops.__doc__ or "").strip(), f"{name}: FLOP model without a docstring"
        assert op.bytes_model.strip(), f"{name}: byte model undocumented"
