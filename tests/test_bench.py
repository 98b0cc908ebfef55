"""`linattn bench`, `verify` and `doctor` on the CPU (Triton under TRITON_INTERPRET=1 when CI sets it)."""
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


def test_bench_tiny_writes_json(tmp_path, capsys):
    backend = _tiny_backend()
    out = tmp_path / "bench.json"
    rc = main(["bench", "--op", "gated_delta_rule", "--preset", "tiny", "--backends", backend, "reference", "sdpa",
               "--modes", "fwd", "--repeats", "2", "--warmup", "1", "--no-cold", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["schema"] == "linattn-bench/1" and res["op"] == "gated_delta_rule" and res["preset"] == "tiny"
    for key in ("env", "env_line", "ceilings", "baseline", "bytes_model", "rows"):
        assert key in res, key
    assert res["env"]["torch"] == torch.__version__
    assert res["ceilings"]["matmul_tflops"] > 0 and res["ceilings"]["copy_gbps"] > 0
    rows = {(r["shape_label"], r["backend"]): r for r in res["rows"]}
    shapes = {r["shape_label"] for r in res["rows"]}
    assert len(shapes) == 2 and any(s.startswith("varlen") for s in shapes)
    for shape in shapes:
        r = rows[(shape, backend)]
        assert r["status"] == "ok", r
        for key in ("median_ms", "min_ms", "max_ms", "tflops", "gbps", "pct_of_floor", "flops", "bytes"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["timing"] == "host clock (cpu)" and r["repeats"] == 2
    # the same-run comparison: whichever linattn backend ran first is the anchor, the other is compared to it
    if backend != "reference":
        for shape in shapes:
            errs = rows[(shape, "reference")]["errors"]
            assert set(errs) == {"o", "final_state"} and all(math.isfinite(e) and e < 1.5e-2 for e in errs.values())
            assert rows[(shape, backend)]["reference_check"]["status"] == "pass"
    else:
        assert all(rows[(s, "reference")]["reference_check"]["status"] == "is the reference" for s in shapes)
    dense = next(s for s in shapes if not s.startswith("varlen"))
    assert rows[(dense, "sdpa")]["status"] == "ok" and "errors" not in rows[(dense, "sdpa")]
    varlen = next(s for s in shapes if s.startswith("varlen"))
    assert rows[(varlen, "sdpa")]["status"] == "skipped" and "varlen" in rows[(varlen, "sdpa")]["reason"]
    assert "median ms" in capsys.readouterr().out


def test_bench_records_unavailable_backends(tmp_path):
    out = tmp_path / "b.json"
    rc = main(["bench", "--preset", "tiny", "--backends", "reference", "nosuch", "fla", "--modes", "fwdbwd",
               "--repeats", "1", "--warmup", "1", "--no-cold", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    nosuch = [r for r in rows if r["backend"] == "nosuch"]
    assert nosuch and all(r["status"] == "skipped" and "not registered" in r["reason"] for r in nosuch)
    ok = [r for r in rows if r["backend"] == "reference"]
    assert ok and all(r["status"] == "ok" and r["mode"] == "fwdbwd" for r in ok)


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
    assert "speedup" not in out and "median ms" not in out and "[bench]" not in out


def test_verify_green_gate_then_benches(capsys):
    rc = main(["verify", "--backend", "reference", "--modes", "fwd", "--peers", "sdpa", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "gate green" in out and "FAIL" not in out
    assert "median ms" in out and "sdpa" in out


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
    def row(shape, mode, backend, ms, status="ok"):
        return dict(shape_label=shape, mode=mode, backend=backend, status=status, median_ms=ms, shape={},
                    min_ms=ms, max_ms=ms, tflops=None, gbps=None, pct_of_floor=None, timing="cuda graph replay")
    d = dict(op="gated_delta_rule", preset="p", env_line="env", ceilings={}, rows=[row(*r) for r in rows],
             cold=[dict(backend=b, mode=m, status="ok", first_call_s=s, second_call_s=0.001, process_s=s + 1)
                   for b, m, s in cold])
    if partial:
        d["partial"] = True
    return d


def test_merge_takes_each_shape_mode_whole_from_one_part(tmp_path):
    """A part cut short plus an earlier full run: each (shape, mode) comes from the part with more rows that ran
    (the first file on a tie), speedups are recomputed inside that part, cold entries deduplicated."""
    from linattn.bench.report import format_table, load_results
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
    got = {(r["shape_label"], r["backend"]): (r["part"], r["median_ms"], r.get("speedup")) for r in m["rows"]}
    assert got[("A", "gluon")] == (0, 0.8, 2.5) and got[("A", "triton")][0] == 0      # more rows ran in part 0
    assert got[("B", "triton")] == (0, 3.0, 2.0)                                        # tie: the first file
    assert got[("C", "triton")] == (1, 5.5, 2.0) and ("C", "sdpa") in got              # part 1 ran C with fla
    assert sum(1 for r in m["rows"] if r["shape_label"] == "C") == 3                    # part 0's C row dropped
    assert m["baseline"] == "fla"
    assert [(c["backend"], c["mode"], c["first_call_s"], c["part"]) for c in m["cold"]] == \
        [("triton", "fwd", 9.0, 0), ("triton", "fwdbwd", 20.0, 1)]
    assert m["parts"][0]["partial"] and m["parts"][0]["rows_taken"] == 5 and m["parts"][1]["rows_taken"] == 3
    table = format_table(m)
    assert "cut short" in table and "[part 1]" in table
