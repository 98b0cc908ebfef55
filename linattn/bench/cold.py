"""Child process of the cold-start measurement: `python -m linattn.bench.cold '<json spec>'`.

Prints one JSON line: the first call's seconds (compile and autotuning included, synchronised) and the
second call's, so the difference is the one-time cost."""
import json
import sys
import time


def _sync(device):
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv) -> int:
    t_start = time.perf_counter()
    spec = json.loads(argv[0])
    from linattn.bench.ops import Unavailable, get_bench_op
    from linattn.bench.timing import step
    op = get_bench_op(spec["op"])
    dev, mode, shape = spec["device"], spec["mode"], spec["shape"]
    inputs = op.make_inputs(shape, dev, 0, mode)
    try:
        runner = op.prepare(spec["backend"], shape, inputs, mode)
    except Unavailable as e:
        print(json.dumps(dict(backend=spec["backend"], mode=mode, status="skipped", reason=str(e))))
        return 0
    kw, leaves, gouts = runner.args(inputs, mode)
    _sync(dev)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        step(runner.fn, kw, leaves, gouts)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    print(json.dumps(dict(backend=spec["backend"], mode=mode, status="ok", first_call_s=times[0],
                          second_call_s=times[1],
                          imports_and_inputs_s=time.perf_counter() - t_start - sum(times))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
