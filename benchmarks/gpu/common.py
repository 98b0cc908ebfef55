"""Shared by the GPU scripts: the environment record (one implementation, linattn.bench.env), JSON writing, the
gate's case runner and the host-clock timer."""
import json
import os


def env_line() -> dict:
    """The environment dict of linattn.bench.env with its one-line summary under "line"."""
    import torch

    from linattn.bench.env import collect_env, env_line as line
    env = collect_env("cuda" if torch.cuda.is_available() else "cpu")
    env["line"] = line(env)
    return env


def run_result(script: str, device: str, **fields) -> dict:
    """A script's result dict as it starts: {"script", "device", **fields, "env": env_line()'s one line (or the
    error that kept it from being read)}."""
    res = dict(script=script, device=device, **fields)
    try:
        res["env"] = env_line()["line"]
    except Exception as e:  # noqa: BLE001
        res["env"] = repr(e)[:200]
    return res


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def case_runner(cases: list):
    """run(name, fn, *args, **kw): one gate case, fn's dict merged into {"case": name}; an exception is recorded as
    passed False with the error and its trace (the next case still runs); the seconds under "s"; appended to
    `cases`."""
    import time
    import traceback

    def run(name, fn, *args, **kw):
        case = dict(case=name)
        t0 = time.time()
        try:
            case.update(fn(*args, **kw))
        except Exception as e:  # noqa: BLE001
            case.update(passed=False, error=f"{e!r}"[:600], trace=traceback.format_exc()[-1500:])
        case["s"] = round(time.time() - t0, 2)
        cases.append(case)
    return run


def run_listed(listed, save) -> dict:
    """A section of (name, fn, kwargs) cases: each through case_runner, the results saved after every case (a
    timeout keeps what ran); returns the section's result."""
    cases = []
    run = case_runner(cases)
    for name, fn, kw in listed:
        run(name, fn, **kw)
        save(dict(cases=cases, incomplete=True))
    return dict(cases=cases)


def host_us(fn, calls: int = 20) -> float:
    """Host-clock us per call of fn over `calls` back-to-back calls with no synchronisation inside (after a
    synchronised warm-up): the Python and launch cost alone while the GPU's launch queue absorbs the kernels
    (calls x launches per call must stay well under the queue's ~1000 entries)."""
    import time

    import torch
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t) * 1e6 / calls
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return us
