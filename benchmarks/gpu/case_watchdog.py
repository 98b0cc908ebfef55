"""Gate cases in a watched child process (shared by gluon_fused_ws_round.py, gluon_bwd_dh_round.py,
gluon_warmup_round.py): a kernel that deadlocks (an mbarrier wait that never completes) costs one case, not the step.

Protocol. The parent starts `child_cmd(todo)` (the same script with a child flag and the names of the cases still to
run). The child (child_loop) runs them in order in ONE process (one CUDA context, one set of compiles), printing
`START <name>` before and `RESULT <json>` after each case. The parent (watch_cases) gives each case `case_timeout`
seconds from its START line; until a first case has finished, `first_timeout` seconds (start-up and compiles). A case
past its limit, or a child that exits without its result, is reported through on_failure(name, why, seconds) (why
begins with "timeout" for a hang), the child's process group is killed and a fresh child takes the remaining cases.
No new case starts once stop() is true: those names are returned (skipped).
"""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback


def child_loop(names, run_one, fake_hang_env=None):
    """In the child: runs run_one(name) -> dict for each name in order, printing START / RESULT lines. An exception
    becomes {"case": name, "ok": False, "error": ..., "trace": ...} (the caller may reshape it: error_row below). If
    the environment variable `fake_hang_env` names a case, that case sleeps forever (tests of the watchdog)."""
    for name in names:
        print("START " + name, flush=True)
        try:
            if fake_hang_env and os.environ.get(fake_hang_env) == name:
                time.sleep(10 ** 6)
            out = run_one(name)
        except Exception as e:  # noqa: BLE001
            out = dict(case=name, ok=False, error=repr(e)[:500], trace=traceback.format_exc()[-3000:])
        print("RESULT " + json.dumps(out, default=str), flush=True)


def child_env(root):
    """The environment for a child: this checkout first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def script_cmd(script, names, *extra):
    """[python, script, "--child-case", json(names), *extra]."""
    return [sys.executable, os.path.abspath(script), "--child-case", json.dumps(list(names)), *extra]


def watch_cases(names, child_cmd, *, case_timeout, first_timeout, stop, on_result, on_failure, env=None,
                hang_note="possible hang in the barrier protocol"):
    """In the parent: runs the cases `names` (in order) in watched children (see the module doc). on_result(row,
    seconds) gets each RESULT's dict (its "case" is the name) and the seconds from its START; on_failure(name, why,
    seconds) each case that timed out or whose child died. Returns the names not started because stop() was true."""
    todo = list(names)
    finished = 0
    while todo:
        if stop():
            return todo
        proc = subprocess.Popen(child_cmd(todo), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        err_tail = []
        threading.Thread(target=lambda: [err_tail.append(ln) for ln in proc.stderr], daemon=True).start()
        current, t_case = None, time.time()
        # the child's start-up (and, for the first case, its compiles) counts against first_timeout
        limit = first_timeout
        while True:
            try:
                ln = lines.get(timeout=max(1.0, limit - (time.time() - t_case)))
            except queue.Empty:
                ln = "TIMEOUT"
            if ln is None or ln == "TIMEOUT":
                name = current or todo[0]
                why = (f"timeout after {limit:.0f} s ({hang_note})" if ln == "TIMEOUT"
                       else "child exited without a result: " + "".join(err_tail[-20:])[-2000:])
                _kill(proc)
                todo = [n for n in todo if n != name]
                finished += 1
                on_failure(name, why, round(time.time() - t_case, 1))
                break
            if ln.startswith("START "):
                current, t_case = ln[6:].strip(), time.time()
                limit = case_timeout if finished else limit
            elif ln.startswith("RESULT "):
                row = json.loads(ln[7:])
                todo = [n for n in todo if n != row["case"]]
                finished += 1
                on_result(row, round(time.time() - t_case, 1))
                if not todo:
                    proc.wait()
                    break
                if stop():
                    _kill(proc)
                    return todo
    return []


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
