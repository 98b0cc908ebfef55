"""Run FLA's own Gated DeltaNet or KDA test file against linattn: FLA's tests, references and tolerances unchanged,
with FLA's public GDN and KDA functions renamed to linattn's (the shim below is the only change).

    python -m linattn.testing.fla_suite --tests PATH/test_gdn.py --out DIR [-- extra pytest args]
    python -m linattn.testing.fla_suite --tests PATH/test_kda.py --out DIR

PATH is a copy of FLA's tests/ops/test_gdn.py (or test_kda.py) kept outside the repository (peers' code is run,
never committed: e.g. a git-ignored .peer/ folder); FLA itself (fla-core, for its references and test utilities)
must be installed. The run is a pytest child process with this module as a plugin (`-p linattn.testing.fla_suite`):
before FLA's test module is imported, `fla.ops.gated_delta_rule.chunk_gated_delta_rule` and
`fused_recurrent_gated_delta_rule`, and `fla.ops.kda.chunk_kda` and `fused_recurrent_kda` (the packages' names and
their defining modules') are replaced by linattn's. Tests of FLA's internals (its kernels,
its FlashQLA dispatch) still run FLA's code and are reported as such. DIR gets fla_suite.json: the outcome per test
id, the counts, FLA's version and the test file's sha256; the outcomes are written as each test ends, so a run stopped
by --timeout-s reports what finished.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from typing import Optional

# per FLA package: the functions replaced, and the modules where FLA defines them (the package re-exports them);
# each replaced where it exists
SHIMS = {
    "fla.ops.gated_delta_rule": (("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
                                 ("fla.ops.gated_delta_rule.chunk", "fla.ops.gated_delta_rule.fused_recurrent")),
    "fla.ops.kda": (("chunk_kda", "fused_recurrent_kda"), ("fla.ops.kda.chunk", "fla.ops.kda.fused_recurrent")),
}


def install_shim() -> dict:
    """Replace FLA's GDN and KDA functions by linattn's in FLA's modules; returns {module: [names replaced]}. FLA's
    GDN package must exist (the KDA one only where this FLA has it)."""
    import importlib

    import linattn
    done = {}
    for package, (names, modules) in SHIMS.items():
        for mod_name in (package, *modules):
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            found = [n for n in names if hasattr(mod, n)]
            for n in found:
                setattr(mod, n, getattr(linattn, n))
            done[mod_name] = found
    first = next(iter(SHIMS))
    if not done.get(first):
        raise RuntimeError(f"{first} has none of {SHIMS[first][0]}: is FLA installed?")
    return done


def pytest_addoption(parser):
    parser.addoption("--linattn-fla-log", default=None, help="append each test's outcome to this JSON-lines file")


def pytest_configure(config):
    """Pytest hook (this module loaded with -p): the shim goes in before any test module is imported."""
    config._linattn_fla_shim = install_shim()
    config._linattn_fla_log = config.getoption("--linattn-fla-log")


def pytest_runtest_logreport(report):
    """Each test's outcome as it ends (a run cut short by the time limit keeps what finished): one JSON line per
    test id, from its call phase, or from setup where that failed or skipped."""
    import pytest
    log = getattr(pytest, "_linattn_fla_log_path", None)
    if log is None or not (report.when == "call" or report.outcome != "passed"):
        return
    outcome = "error" if report.when != "call" and report.outcome == "failed" else report.outcome
    rec = {"id": report.nodeid, "outcome": outcome, "seconds": round(getattr(report, "duration", 0.0), 3)}
    if report.outcome != "passed":
        # why: the last lines of the failure (the exception and its message) or the skip reason
        rec["reason"] = "\n".join(str(report.longrepr).strip().splitlines()[-3:])[-600:]
    with open(log, "a") as f:
        f.write(json.dumps(rec) + "\n")


def pytest_sessionstart(session):
    import pytest
    pytest._linattn_fla_log_path = session.config._linattn_fla_log


def pytest_report_header(config):
    return f"linattn FLA shim: {getattr(config, '_linattn_fla_shim', {})}"


def summarise(log_path: str) -> dict:
    """{'tests': {id: outcome}, 'counts': {...}, 'seconds': {id: s}, 'reasons': {id: why}} from the plugin's JSON lines (outcome: passed,
    failed, error, skipped; the last line of an id wins)."""
    tests, seconds, reasons = {}, {}, {}
    if os.path.exists(log_path):
        with open(log_path) as f:
            for line in f:
                rec = json.loads(line)
                tests[rec["id"]] = rec["outcome"]
                seconds[rec["id"]] = rec["seconds"]
                if "reason" in rec:
                    reasons[rec["id"]] = rec["reason"]
    counts = {}
    for o in tests.values():
        counts[o] = counts.get(o, 0) + 1
    return {"tests": tests, "counts": counts, "seconds": seconds, "reasons": reasons}


def run(tests_path: str, out_dir: str, extra=(), timeout_s: Optional[float] = None) -> dict:
    """Run FLA's test file under the shim; returns (and writes to out_dir/fla_suite.json) the outcomes. timeout_s:
    stop the run after that long; the tests that finished by then are reported, and `timed_out` says so."""
    os.makedirs(out_dir, exist_ok=True)
    log = os.path.join(out_dir, "fla_suite_outcomes.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "linattn.testing.fla_suite",
           f"--linattn-fla-log={log}", "--rootdir", os.path.dirname(os.path.abspath(tests_path)), tests_path, *extra]
    timed_out, returncode, output = False, None, ""
    try:
        # FLA's file skips its GVA cases (HV > H) unless FLA's backend dispatch is off: the skip is about FLA's
        # tilelang backend, which linattn does not dispatch to, so the cases run
        env = dict(os.environ, FLA_DISABLE_BACKEND_DISPATCH="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        timed_out = True
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    res = summarise(log)
    try:
        from importlib.metadata import version
        fla_version = version("fla-core")
    except Exception:  # noqa: BLE001 - reported, not fatal
        fla_version = None
    with open(tests_path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    res.update(fla_version=fla_version, tests_file_sha256=sha, returncode=returncode, timed_out=timed_out,
               output_tail=output[-4000:])
    with open(os.path.join(out_dir, "fla_suite.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", required=True, help="a copy of FLA's tests/ops/test_gdn.py or test_kda.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=None, help="stop after this long, keeping what finished")
    ap.add_argument("extra", nargs="*", help="further pytest arguments (after --)")
    a = ap.parse_args(argv)
    res = run(a.tests, a.out, a.extra, a.timeout_s)
    print(json.dumps(res["counts"]), "fla", res["fla_version"], "(timed out)" if res["timed_out"] else "")
    for tid, o in res["tests"].items():
        if o != "passed":
            print(o, tid, "|", res["reasons"].get(tid, "").replace("\n", " | ")[-300:])
    return 0 if res["counts"] and not res["counts"].get("failed") and not res["counts"].get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
