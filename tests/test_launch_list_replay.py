"""A launch list's generated replay (runtime/launch_list.py, LaunchList._compile), on a synthetic record: launches on
the current stream and on a side stream with event steps between them, an output buffer, a zero-filled buffer and a
workspace buffer. The replay on new inputs makes the recorded steps in the recorded order, each launch with its
constants as recorded and each pointer moved to the new input or buffer at the same offset, the event steps on the
recorded streams (the current one as the list's current stream object), and returns the new output buffer; the
zero-filled and the other buffer lie in one fresh workspace allocation, the zero-filled one zeroed (also when
allocations are poisoned, which fill the rest with NaN bytes); an unaligned input declines the replay (None,
nothing made)."""
import ctypes

import torch

from linattn.runtime import launch_list as LL


class _Stream:
    def __init__(self, handle):
        self.cuda_stream = handle

    def wait_event(self, event):
        CALLS.append(("wait", event, self))


class _Event:
    def record(self, stream):
        CALLS.append(("record", self, stream))


class _HostPath:
    plan_cache = True
    handle = True


CALLS = []


def _run(gx, gy, gz, stream, function, packed, launch_meta, enter, leave, *args):
    # (the bytes behind the integer arguments that are CPU addresses, read while the replay's buffers are alive)
    mem = {a: ctypes.string_at(a, 16) for a in args if type(a) is int and a > 1 << 20}
    CALLS.append(("launch", (gx, gy, gz), stream, function, packed, args, mem))


def _build():
    q = torch.randn(64)
    out = torch.empty(32)
    zero = torch.zeros(8, dtype=torch.int32)
    work = torch.empty(16)
    cur, side = _Stream(5), _Stream(7)
    ev1, ev2 = _Event(), _Event()
    raw = (_run, "function", "packed", lambda device: 5)
    rec = LL.Recorder(current_stream=cur)
    rec.allocs += [(out, False), (zero, True), (work, False)]
    rec.steps += [("record", ev1, cur), ("wait", ev1, side),
                  ("launch", raw, (2, 1, 1), side, (q, work, 3, 0.5, None)),
                  ("record", ev2, side), ("wait", ev2, cur),
                  ("launch", raw, (1, 1, 1), None, (q[8:], zero, out, work[4:], True))]
    lst = LL.LaunchList.build(rec, (q,), (out,), 0, _HostPath(), lambda: 0, lambda: False, lambda: False)
    assert lst is not None
    return lst, (cur, side, ev1, ev2)


def test_generated_replay():
    lst, (cur, side, ev1, ev2) = _build()
    current = _Stream(5)
    lst.stream = current                 # the list's current-stream object (on a GPU: an ExternalStream of handle 5)
    # the output allocated as recorded; the zero-filled buffer first in the workspace, then the other one
    assert lst.layout == (None, 0, LL.WORKSPACE_ALIGN) and lst.ws_bytes == 2 * LL.WORKSPACE_ALIGN
    q2 = torch.randn(64)
    del CALLS[:]
    lst.poisoning = lambda: True                      # poisoned buffers: the zero-filled one zeroed after
    (out2,) = lst(q2)
    lst.poisoning = lambda: False
    zero_ptr, work_ptr = CALLS[5][5][1], CALLS[2][5][1]
    assert CALLS[5][6][zero_ptr] == bytes(16) and CALLS[2][6][work_ptr] == b"\xff" * 16
    assert bool(out2.isnan().all())
    assert isinstance(out2, torch.Tensor) and out2.shape == (32,)
    kinds = [c[0] for c in CALLS]
    assert kinds == ["record", "wait", "launch", "record", "wait", "launch"], kinds
    assert CALLS[0][1] is ev1 and CALLS[0][2] is current
    assert CALLS[1][1] is ev1 and CALLS[1][2] is side
    _, grid, stream, function, packed, args, _ = CALLS[2]
    assert (grid, stream, function, packed) == ((2, 1, 1), 7, "function", "packed")
    w = args[1]
    assert args[0] == q2.data_ptr() and args[2:] == (3, 0.5, None), args
    assert CALLS[3][1] is ev2 and CALLS[3][2] is side
    assert CALLS[4][1] is ev2 and CALLS[4][2] is current
    _, grid, stream, _, _, args, _ = CALLS[5]
    assert (grid, stream) == ((1, 1, 1), 5)
    assert args[0] == q2.data_ptr() + 32 and args[2] == out2.data_ptr() and args[3] == w + 16 and args[4] is True
    assert args[1] not in (w, out2.data_ptr(), q2.data_ptr()) and isinstance(args[1], int)
    # a second replay: a new output, the same steps
    del CALLS[:]
    (out3,) = lst(q2)
    assert out3 is not out2 and [c[0] for c in CALLS] == kinds
    # an input that is not 16-byte aligned: declined before anything is made
    del CALLS[:]
    assert lst(torch.randn(65)[1:]) is None and CALLS == []
