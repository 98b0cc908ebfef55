"""call_memo.call_key: equal for calls a memo may treat alike (same shapes, strides, dtypes, devices, types, grad
flags, options), different wherever one of those differs."""
import torch

from linattn.runtime.call_memo import call_key


class _Sub(torch.Tensor):
    pass


def _key(*tensors, backend="auto", scale=0.5, pad=-1, flags=(True,)):
    return call_key(backend, tensors, scale, pad, flags)


def test_call_key_equal_and_different():
    shape = (1, int(torch.randint(2, 5, ())), 4, 8)                       # >= 2: the transpose moves strides
    a, b = torch.randn(shape), torch.randn(shape)
    base = _key(a, None, b)
    assert base is not None and base == _key(b.clone(), None, a.clone())    # other tensors, same signature
    assert hash(base) == hash(_key(torch.randn(shape), None, torch.randn(shape)))
    others = [
        _key(a, None, b.to(torch.float64)),                                 # dtype
        _key(a, None, b.transpose(1, 2).contiguous().transpose(1, 2)),      # strides
        _key(a, None, torch.randn(shape[0], shape[1] + 1, *shape[2:])),    # shape
        _key(a, None, b.requires_grad_(True)),                             # grad flag
        _key(a, None, b.detach().as_subclass(_Sub)),                       # tensor subclass
        _key(a, b.detach(), None),                                         # which argument is absent
        _key(a, None, 3),                                                  # not a tensor
        _key(a, None, b.detach(), scale=0.25),                             # options
        _key(a, None, b.detach(), flags=(False,)),
        _key(a, None, b.detach(), backend="triton"),
    ]
    assert [i for i, k in enumerate(others) if k is None or k == base] == []
    assert len(set(others)) == len(others)
    assert _key(a, None, b.detach(), scale=torch.tensor(0.5)) is None       # a scale of another type: no key
