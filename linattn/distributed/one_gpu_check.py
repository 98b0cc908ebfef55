"""One-GPU check of the context-parallel pass (W = 2) with real exchanged values, for when no two-GPU machine is at
hand (linattn.distributed.multi_gpu is the gate on several GPUs).

The two ranks run one after another in this process (rank 0 forward, rank 1 forward, rank 1 backward, rank 0
backward); SeqComm hands each rank what the earlier rank contributed, the only values a rank reads at W = 2. No final
states (their all-reduce needs both ranks at once). Against the one-process call on the same GPU, bf16, B1 H16/HV32
K = V = 128: the output, every gradient and the initial state's (summed over the ranks), at the bf16 tolerance; with
the production decay (the summaries' windows taken) and a slow one (not taken), backends auto and triton.

    python3 -m linattn.distributed.one_gpu_check --out cp_seq_check.json
"""
import argparse
import json
import sys

import torch
import linattn
from linattn.distributed import build_cp_context
from linattn.distributed.chunk import gdn_cp_op
from linattn.testing.compare import rel_rms, TOL
from linattn.testing.inputs import make_gdn_inputs


class SeqComm:
    """Rank `rank`'s collectives when the ranks run one after another: the k-th all-gather records this rank's
    tensor under k and returns what the ranks that ran before contributed there (zeros for the others)."""

    def __init__(self, store, rank, W):
        self.store, self.rank, self.world_size, self.k, self.group = store, rank, W, 0, None

    def all_gather(self, t):
        slot = self.store.setdefault(self.k, {})
        self.k += 1
        slot[self.rank] = t.detach().clone()
        return torch.stack([slot.get(r, torch.zeros_like(t)) for r in range(self.world_size)])

    def all_reduce_(self, t):
        raise RuntimeError("no all-reduce in this check")


NAMES = ("q", "k", "v", "g", "beta")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    res = []
    for T, lengths, slow in ((32768, [5000, 20000, 7768], False), (16384, [16384], False), (32768, [32768], True)):
        x = make_gdn_inputs(1, T, 16, 32, 128, 128, dtype=torch.bfloat16, device=dev, num_states=len(lengths))
        if slow:   # no window: every head runs the whole range
            x["g"] = -0.0005 * torch.rand_like(x["g"])
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=dev)
        do = torch.randn(1, T, 32, 128, device=dev).to(torch.bfloat16)
        for backend in ("auto", "triton"):
            xs = {n: x[n].clone().requires_grad_(True) for n in NAMES}
            h0 = x["initial_state"].clone().requires_grad_(True)
            o1, _ = linattn.chunk_gated_delta_rule(**xs, initial_state=h0, cu_seqlens=cu, backend=backend)
            o1.backward(do)
            ref = dict(o=o1.detach(), dh0=h0.grad, **{"d" + n: xs[n].grad for n in NAMES})
            store, P = {}, T // 2
            ranks = []
            for r in (0, 1):
                cp = build_cp_context(cu, rank=r, world_size=2, comm=SeqComm(store, r, 2))
                xr = {n: x[n][:, r * P:(r + 1) * P].clone().requires_grad_(True) for n in NAMES}
                hr = x["initial_state"].clone().requires_grad_(True)
                o, _ = linattn.chunk_gated_delta_rule(**xr, initial_state=hr, cp_context=cp, backend=backend)
                ranks.append((cp, xr, hr, o))
            for r in (1, 0):
                cp, xr, hr, o = ranks[r]
                o.backward(do[:, r * P:(r + 1) * P])
            got = dict(o=torch.cat([rk[3].detach() for rk in ranks], 1), dh0=ranks[0][2].grad + ranks[1][2].grad,
                       **{"d" + n: torch.cat([rk[1][n].grad for rk in ranks], 1) for n in NAMES})
            errs = {k: rel_rms(got[k].float(), ref[k].float()) for k in ref}
            why = gdn_cp_op(ranks[0][1]["q"], ranks[0][1]["v"], ranks[0][0], backend)[1]
            row = dict(T=T, lengths=lengths, slow_decay=slow, backend=backend, kernels=why, errors=errs,
                       passed=all(e <= TOL[torch.bfloat16] for e in errs.values()))
            print(row, flush=True)
            res.append(row)
    from linattn.bench.env import collect_env, env_line
    env = collect_env(dev)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, env_line=env_line(env), rows=res), f, indent=1)
    ok = all(r["passed"] for r in res)
    print("ALL PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
