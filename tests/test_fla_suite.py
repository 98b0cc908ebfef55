"""linattn.testing.fla_suite (the runner of FLA's own GDN test file against linattn), on a stand-in FLA package: the
shim replaces FLA's two functions before the test module imports them, and the per-test outcomes are read back."""
import os
import textwrap

from linattn.testing import fla_suite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))


def test_runner_on_stand_in_fla(tmp_path, monkeypatch):
    pkg = tmp_path / "site"
    for init in ("fla/__init__.py", "fla/ops/__init__.py"):
        _write(str(pkg / init), "")
    _write(str(pkg / "fla/ops/gated_delta_rule/__init__.py"), """
        def chunk_gated_delta_rule(*args, **kwargs):
            raise AssertionError("FLA's own function was called")

        def fused_recurrent_gated_delta_rule(*args, **kwargs):
            raise AssertionError("FLA's own function was called")
        """)
    _write(str(pkg / "fla/ops/kda/__init__.py"), """
        from fla.ops.kda.chunk import chunk_kda

        def fused_recurrent_kda(*args, **kwargs):
            raise AssertionError("FLA's own function was called")
        """)
    _write(str(pkg / "fla/ops/kda/chunk.py"), """
        def chunk_kda(*args, **kwargs):
            raise AssertionError("FLA's own function was called")
        """)
    tests = tmp_path / "tests" / "test_gdn.py"
    _write(str(tests), """
        import pytest
        import linattn
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        from fla.ops.kda.chunk import chunk_kda as chunk_kda_defined

        def test_chunk_is_linattn():
            assert chunk_gated_delta_rule is linattn.chunk_gated_delta_rule
            assert chunk_kda is chunk_kda_defined is linattn.chunk_kda
            assert fused_recurrent_kda is linattn.fused_recurrent_kda

        def test_recurrent_is_linattn():
            assert fused_recurrent_gated_delta_rule is linattn.fused_recurrent_gated_delta_rule

        def test_a_failure_is_reported():
            assert False

        @pytest.mark.skip(reason="stand-in")
        def test_skipped():
            pass
        """)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pkg), ROOT, os.environ.get("PYTHONPATH", "")]))
    res = fla_suite.run(str(tests), str(tmp_path / "out"))
    assert res["counts"] == {"passed": 2, "failed": 1, "skipped": 1}, res["output_tail"]
    outcomes = {tid.split("::")[-1]: o for tid, o in res["tests"].items()}
    assert outcomes == {"test_chunk_is_linattn": "passed", "test_recurrent_is_linattn": "passed",
                        "test_a_failure_is_reported": "failed", "test_skipped": "skipped"}
    assert len(res["tests_file_sha256"]) == 64 and res["timed_out"] is False
    assert os.path.exists(tmp_path / "out" / "fla_suite.json")


def test_runner_keeps_what_finished_when_stopped(tmp_path, monkeypatch):
    """A run stopped by its time limit reports the tests that ended before it."""
    pkg = tmp_path / "site"
    for init in ("fla/__init__.py", "fla/ops/__init__.py"):
        _write(str(pkg / init), "")
    _write(str(pkg / "fla/ops/gated_delta_rule/__init__.py"), """
        def chunk_gated_delta_rule(*args, **kwargs):
            pass

        def fused_recurrent_gated_delta_rule(*args, **kwargs):
            pass
        """)
    tests = tmp_path / "tests" / "test_gdn.py"
    _write(str(tests), """
        import time

        def test_a_quick_one():
            pass

        def test_b_slow_one():
            time.sleep(60)
        """)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pkg), ROOT, os.environ.get("PYTHONPATH", "")]))
    # the limit outlasts the child's start (python, pytest, torch and linattn imports: ~3-6 s on a loaded CI machine)
    # and the quick test, and ends well before the slow one's 60 s
    res = fla_suite.run(str(tests), str(tmp_path / "out"), timeout_s=12)
    assert res["timed_out"] is True
    assert {tid.split("::")[-1]: o for tid, o in res["tests"].items()} == {"test_a_quick_one": "passed"}
