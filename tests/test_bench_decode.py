"""`linattn bench --modes decode` (linattn.bench.decode) on the CPU: the decode preset's rows run, each backend's
first call starts from the same states (the pool is reset by args), the first backend is checked against the fp64
reference, the roofline counts the state's bytes, and issue 6's targets are read off the rows."""
import importlib.util
import json
import math
import os

import pytest
import torch

from linattn.cli import main


def _ours() -> str:
    return "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"


def test_bench_decode_tiny(tmp_path, capsys):
    """One fresh process per backend (--procs 1): every decode_tiny row runs, the first backend is checked against
    the fp64 reference, the later ones against it, the roofline counts the state's bytes."""
    ours = _ours()
    out = tmp_path / "decode.json"
    backends = ["auto", ours, "reference", "fla"] if ours == "triton" else ["reference", "fla"]
    rc = main(["bench", "--modes", "decode", "--backends", *backends, "--procs", "1", "--repeats", "2", "--warmup", "1",
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["op"] == "gated_delta_rule_decode" and res["preset"] == "decode_tiny" and res["modes"] == ["decode"]
    assert res["cold"] == []                                   # no cold start by default for decode
    assert [(p["backend"], p["round"]) for p in res["processes"]] == [(b, 0) for b in backends]
    assert res["targets"] == {"graph": {}, "eager": {}}        # no pool row at the targets' batch sizes here
    rows = {(r["shape_label"], r["backend"]): r for r in res["rows"]}
    shapes = sorted({r["shape_label"] for r in res["rows"]})
    assert len(shapes) == 3 and sum("pool in place" in s for s in shapes) == 2 and any("no pool" in s for s in shapes)
    for s in shapes:
        r = rows[(s, backends[0])]
        assert r["status"] == "ok", r
        shape = r["shape"]
        es = 4 if shape["state"] == "float32" else 2
        assert r["bytes"] == 2 * shape["B"] * shape["HV"] * shape["K"] * shape["V"] * es
        assert r["eager"]["pct_of_floor"] > 0 and r["graph"]["status"] == "n/a"
        if ours == "triton":
            # the first backend against fp64, the others against it; every backend's first call from the same
            # start states: auto and triton are the same kernel here, so bit-equal
            assert r["reference_check"]["status"] == "pass", r["reference_check"]
            want = {"o"} if shape["pool"] else {"o", "final_state"}
            assert set(r["reference_check"]["errors"]) == want
            assert rows[(s, "triton")]["errors"] == {n: 0.0 for n in want}
            assert rows[(s, "triton")]["compared_to"] == "auto"
            assert all(math.isfinite(e) and e < 1.5e-2 for e in rows[(s, "reference")]["errors"].values())
        fla = rows[(s, "fla")]
        if importlib.util.find_spec("fla") is None:    # the CI machine: recorded as unavailable, with the reason
            assert fla["status"] == "skipped" and "fla not importable" in fla["reason"], fla
        elif fla["status"] == "ok":                    # installed and runnable here: compared with the first backend
            assert all(math.isfinite(e) and e < 1.5e-2 for e in fla["errors"].values()), fla
        else:                                          # installed but not runnable here: the row says why
            assert fla["status"] in ("skipped", "error") and fla["reason"], fla
    assert "eager ms" in capsys.readouterr().out


def test_bench_decode_refuses_peers_without_a_decode_step():
    from linattn.bench.base import Unavailable
    from linattn.bench.decode import decode_inputs, decode_prepare
    from linattn.bench.presets import get_preset
    shape = get_preset("decode_tiny")[0]
    inp = decode_inputs(shape, "cpu", seed=int(torch.randint(0, 1 << 30, ())))
    for peer in ("sdpa", "flashqla"):
        with pytest.raises(Unavailable, match="no decode step"):
            decode_prepare(peer, shape, inp, "decode")


def test_bench_decode_pool_reset_makes_first_calls_equal():
    """args() puts the set's start states back into its pool slots before a backend's check call: two runs of the
    same kernel with timed in-place calls in between give the same o."""
    from linattn.bench.decode import decode_inputs, decode_prepare
    from linattn.bench.presets import get_preset
    from linattn.bench.timing import step
    shape = get_preset("decode_tiny")[0]
    inp = decode_inputs(shape, "cpu", seed=int(torch.randint(0, 1 << 30, ())))
    start = inp["pool"].clone()
    assert torch.equal(inp["pool"][inp["idx"].long()], inp["h0"])
    r = decode_prepare(_ours(), shape, inp, "decode")
    first = step(r.fn, *r.args(inp, "decode"))[0][0].clone()
    for _ in range(2):                                       # the "timed" calls: the pool moves on
        step(r.fn, *r.args(inp, "decode")[:1], (), ())
    if _ours() == "triton":
        assert not torch.equal(inp["pool"], start)
    again = step(r.fn, *r.args(inp, "decode"))[0][0]
    assert torch.equal(first, again)


def test_bench_decode_refusals(capsys):
    assert main(["bench", "--modes", "fwd", "decode"]) == 2
    assert "alone" in capsys.readouterr().err
    assert main(["bench", "--modes", "decode", "--preset", "tiny"]) == 2
    assert "not a decode preset" in capsys.readouterr().err
    assert main(["bench", "--modes", "fwd", "--preset", "decode_tiny"]) == 2
    assert "is a decode preset" in capsys.readouterr().err
    assert main(["bench", "--op", "gated_delta_rule", "--modes", "decode"]) == 2
    assert "has no mode 'decode'" in capsys.readouterr().err
    for flag in ("--procs", "--repeats"):
        assert main(["bench", "--modes", "decode", flag, "0"]) == 2
        assert f"{flag} must be at least 1" in capsys.readouterr().err


def _row(B, state, backend, ms, pct, family="linattn"):
    """A decode row with both timing columns: the eager one 10x slower at a tenth of the floor's share."""
    return dict(status="ok", mode="decode", backend=backend, family=family, shape=dict(B=B, state=state, pool=True),
                graph=dict(status="ok", median_ms=ms, pct_of_floor=pct),
                eager=dict(status="ok", median_ms=10 * ms, pct_of_floor=pct / 10))


@pytest.mark.parametrize("b256_ms,pct", [(0.280, 90.4), (0.282, 89.5)])
def test_decode_targets(b256_ms, pct):
    from linattn.bench.decode import decode_targets
    rows = [_row(1, "float32", "auto", 0.0033, 30.0), _row(1, "float32", "triton", 0.0040, 25.0),
            _row(1, "float32", "fla", 0.0034, 29.0, "peer"), _row(32, "float32", "auto", 0.0420, 75.0),
            _row(32, "float32", "fla", 0.0410, 77.0, "peer"), _row(256, "float32", "auto", b256_ms, pct),
            _row(256, "bfloat16", "auto", b256_ms / 1.8, 80.0),
            dict(_row(256, "float32", "auto", 0.1, 99.0), shape=dict(B=256, state="float32", pool=False))]
    t = decode_targets(rows)
    assert t["batch256_fp32_pct_of_copy"] == pct and t["batch256_ge_90pct_copy"] == (pct >= 90.0)
    assert t["batch1_not_slower_than_fla"] is True                # the first linattn row (auto), not triton's
    assert t["batch32_not_slower_than_fla"] is False
    assert t["batch1_le_8us"] is True and abs(t["batch1_us"] - 3.3) < 1e-9
    assert abs(t["bf16_speedup_b256"] - 1.8) < 1e-9 and t["bf16_ge_1.7x_b256"] is True
    e = decode_targets(rows, "eager")                              # the eager column: its own numbers
    assert e["batch1_us"] == pytest.approx(33.0) and e["batch1_le_8us"] is False
    assert e["batch256_fp32_pct_of_copy"] == pytest.approx(pct / 10) and e["batch256_ge_90pct_copy"] is False
    assert "kda_batch256_fp32_pct_of_copy" not in t                 # no KDA row
    kda = dict(_row(256, "float32", "auto", 0.27, 91.0), shape=dict(B=256, state="float32", pool=True, decay="channel"))
    tk = decode_targets(rows + [kda])
    assert tk["kda_batch256_fp32_pct_of_copy"] == 91.0 and tk["kda_batch256_ge_90pct_copy"] is True
    assert tk["batch256_fp32_pct_of_copy"] == pct                    # GDN's target still from GDN's row
    vf = dict(_row(256, "float32", "auto", 0.30, 84.0),
              shape=dict(B=256, state="float32", pool=True, decay="channel", v_first=True))
    tv = decode_targets(rows + [vf, kda])                            # each state layout its own target
    assert tv["kda_batch256_fp32_pct_of_copy"] == 91.0 and tv["kda_v_first_batch256_fp32_pct_of_copy"] == 84.0
    assert tv["kda_v_first_batch256_ge_90pct_copy"] is False
    rows[5] = dict(rows[5], graph=dict(status="n/a", reason="capture failed"))
    assert "batch256_fp32_pct_of_copy" not in decode_targets(rows)   # a row without the column: target absent


def test_bench_kda_decode_tiny(tmp_path):
    """The KDA decode rows (preset kda_decode_tiny: per-key-channel decay, pool and FLA's mode, K-first and V-first
    states): the first backend checked against the fp64 reference (fused_recurrent_reference with gk), the roofline
    on the state's bytes."""
    ours = _ours()
    out = tmp_path / "kda_decode.json"
    backends = [ours, "reference"]
    rc = main(["bench", "--modes", "decode", "--preset", "kda_decode_tiny", "--backends", *backends, "--procs", "1",
               "--repeats", "2", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    rows = [r for r in res["rows"] if r["backend"] == ours]
    assert len(rows) == 4 and all(r["status"] == "ok" and "KDA" in r["shape_label"] for r in rows)
    assert sum("V-first" in r["shape_label"] for r in rows) == 2
    for r in rows:
        shape = r["shape"]
        assert r["bytes"] == 2 * shape["B"] * shape["HV"] * shape["K"] * shape["V"] * 4
        if ours == "triton":
            assert r["reference_check"]["status"] == "pass", r["reference_check"]
