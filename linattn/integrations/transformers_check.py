"""Checks and timings of linattn inside transformers' Qwen3-Next, for a GPU (and, at tiny sizes, a CPU).

    python3 -m linattn.integrations.transformers_check --out result.json            # CUDA
    TRITON_INTERPRET=1 python3 -m linattn.integrations.transformers_check --dry-run --out result.json

1. The tiny-model check (`check_tiny_model`, also the model line of `linattn demo`): a random 2-layer Qwen3-Next
   (a GatedDeltaNet layer and a full-attention layer, a small MoE) run by transformers' own path and, after
   `linattn.integrations.transformers.enable`, by linattn: greedy generate() of both (prefill, then one-token decode
   steps through the cache) must give the same tokens, and the logits are compared by relative RMS error with the
   dtype's tolerance against transformers' own logits and against an fp64 forward of the same tokens (no cache;
   its GatedDeltaNet core on linattn's plain-PyTorch reference in fp64). On CUDA in fp32 and bf16 (in bf16 a
   near-tie can flip a greedy token, so only fp32 requires equal tokens).
2. The layer timing: a realistic GatedDeltaNet layer (hidden 2048, 16 q/k heads, 32 v heads, head dim 128, bf16),
   linattn.layers.GatedDeltaNet against fla.layers.GatedDeltaNet when FLA is importable (fla.layers is in the
   flash-linear-attention wheel, not in fla-core; --kda: KimiDeltaAttention the same way, key layer_kda) (FLA's
   weights loaded into
   linattn's layer; their outputs compared): a training step (forward + backward) at B1 T8192 and B8 T4096, and a
   decode step after a prefill at batch 1 and 64, eager and replayed from a CUDA graph. Eager times are the median
   of CUDA-event times of back-to-back calls. Each row also gives the relative RMS difference of linattn's output
   (and, training, of dx) from FLA's. --dry-run shrinks every size and times on the CPU (no graphs).

Writes one JSON (--out) with the environment; exit status 1 when a model check fails or a linattn row errors
(FLA's errors are recorded, not fatal)."""
import argparse
import contextlib
import copy
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from linattn.integrations import transformers as lt
from linattn.ops.gated_delta_rule import reference
from linattn.testing.compare import TOL, rel_rms

LAYER = dict(hidden_size=2048, head_dim=128, num_heads=16, num_v_heads=32, expand_v=1)
LAYER_DRY = dict(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=1)
TRAIN_SHAPES = ((1, 8192), (8, 4096))
TRAIN_SHAPES_DRY = ((1, 40), (2, 24))
DECODE_BATCHES = (1, 64)
DECODE_BATCHES_DRY = (1, 3)


# --------------------------------------------------------------------------------------------- the tiny model

def tiny_config(**overrides):
    """A 2-layer Qwen3-Next: one GatedDeltaNet layer (2 q/k heads, 4 v heads, head dims 16, conv width 4), one
    full-attention layer, a 4-expert MoE; hidden 64, vocab 128. Weights drawn with std 0.2 (transformers' 0.02
    leaves the GatedDeltaNet layer so small a part of the logits that a 1% error in it moves them by 6e-4, under
    the fp32 tolerance; at 0.2 it moves them by 7e-3 and dropping the layer changes them entirely)."""
    from transformers import Qwen3NextConfig
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=256,
              initializer_range=0.2)
    kw.update(overrides)
    return Qwen3NextConfig(**kw)


def build_tiny_model(device="cpu", dtype=torch.float32, seed=0, config=None):
    """The tiny model with seeded random weights, in eval mode, built with the module globals as they are now."""
    from transformers import Qwen3NextForCausalLM
    from transformers.utils import logging as hf_logging
    config = config or tiny_config()
    config.dtype = dtype
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()      # transformers' own path warns that FLA and causal-conv1d are missing
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3NextForCausalLM(config)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device=device, dtype=dtype).eval()


def _ref_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
    """transformers 5.x's causal_conv1d_fn call (x [B, D, T] holding any cached columns, no state) in plain
    PyTorch, for the fp64 forward."""
    y = F.conv1d(F.pad(x, (weight.shape[-1] - 1, 0)), weight.unsqueeze(1), bias, groups=x.shape[1])
    return F.silu(y) if activation in ("silu", "swish") else y


def _ref_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """causal_conv1d_update (x [B, D, T], conv_state [B, D, S] updated in place) in plain PyTorch."""
    xx = torch.cat([conv_state, x], -1)
    conv_state.copy_(xx[..., -conv_state.shape[-1]:])
    return _ref_conv1d_fn(xx, weight, bias, activation)[..., -x.shape[-1]:]


@contextlib.contextmanager
def _module_functions(mod, fns: dict):
    """transformers 5.x: the module's kernel functions replaced by `fns` while inside (its layers call the module's
    functions at each forward, so the ops cannot be chosen per model); nothing on 4.x (`fns` empty)."""
    saved = {n: getattr(mod, n) for n in fns}
    try:
        for n, f in fns.items():
            setattr(mod, n, f)
        yield
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)


def own_path():
    """A context in which Qwen3-Next runs transformers' own kernel functions, also while linattn is enabled: on 5.x
    the module's functions (transformers' originals) for the time inside; on 4.x nothing (a model keeps the
    functions it was built with)."""
    mod = lt._module()
    if lt.hooks(mod) == "layer":
        return contextlib.nullcontext()
    orig = lt._originals(mod)
    return _module_functions(mod, {n: orig[n] for n in lt.CALLED_GLOBALS if n != "Qwen3NextRMSNormGated"})


def fp64_logits(model, ids):
    """The logits of a no-cache forward of `ids` by a copy of `model` in fp64 whose GatedDeltaNet layers run their
    core and gated norm on linattn's plain-PyTorch references in fp64 (transformers' own torch fallbacks compute
    both in fp32) and their convolution in plain PyTorch (4.x: transformers' F.conv1d path)."""
    mod = lt._module()
    ref = copy.deepcopy(model).double()
    if getattr(ref.config, "_experts_implementation", None) not in (None, "eager"):
        ref.config._experts_implementation = "eager"     # 5.x's default grouped_mm takes no fp64
    base = lt._originals(mod)["Qwen3NextRMSNormGated"]
    fns = {}
    for layer in lt._layers(mod, ref):
        lt._patch_norm(layer, base)           # linattn's gated norm module (also in place of FLA's)
        layer.norm.backend = "reference"
        if lt.hooks(mod) == "layer":
            layer.chunk_gated_delta_rule = reference.chunk_gated_delta_rule
            layer.recurrent_gated_delta_rule = reference.naive_recurrent
            layer.causal_conv1d_fn = None
            layer.causal_conv1d_update = mod.torch_causal_conv1d_update
    if lt.hooks(mod) == "module":
        fns = dict(torch_chunk_gated_delta_rule=lt.drop_unknown_kwargs(reference.chunk_gated_delta_rule),
                   torch_recurrent_gated_delta_rule=lt.drop_unknown_kwargs(reference.naive_recurrent),
                   causal_conv1d_fn=_ref_conv1d_fn, causal_conv1d_update=_ref_conv1d_update)
    with torch.no_grad(), _module_functions(mod, fns):
        return ref(ids).logits


def _generate(model, ids, new_tokens):
    """Greedy generate() exactly new_tokens tokens: (sequences [B, P + new], step logits [new, B, vocab] fp32)."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack([x.float() for x in out.logits])


def check_tiny_model(device="cpu", dtype=torch.float32, new_tokens=8, batch=2, prompt_len=16, seed=0,
                     fp64=True) -> dict:
    """The tiny-model check of the module docstring; returns its numbers and "passed". Leaves enable()'s global
    state as it found it. fp64=False (fp32 only) skips the fp64 forward and the extra forward of each model (the
    demo's quick form: tokens and step logits against transformers' own).

    The verdict: in fp32, equal tokens and every error of linattn's logits (against transformers' own and against
    fp64) within the fp32 tolerance. In bf16 / fp16 the logits of the whole model carry the rounding of every
    layer, not only of the one under test, so linattn's errors against fp64 must be within the tolerance or at
    most 1.25x transformers' own error against fp64 at the same dtype; the comparisons with transformers' own
    logits and tokens are reported. own_forward_vs_fp64 (transformers' own error) never decides."""
    if dtype not in TOL:
        raise ValueError(f"dtype must be one of {list(TOL)}, got {dtype}")
    if not fp64 and dtype != torch.float32:
        raise ValueError("fp64=False is the fp32 quick form; other dtypes are judged against the fp64 forward")
    was_enabled = lt.is_enabled()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    # fp32 means fp32 here: TF32 matrix units would put transformers' own path at about 1e-3 of the fp64 logits
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    lt.disable()
    try:
        own = build_tiny_model(device, dtype, seed)
        lin = lt.enable(copy.deepcopy(own))
        gen = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(1, own.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
        with own_path():
            seq_own, logits_own = _generate(own, ids, new_tokens)
        seq_lin, logits_lin = _generate(lin, ids, new_tokens)
        tol = TOL[dtype]
        res = dict(device=str(device), dtype=str(dtype).replace("torch.", ""), seed=seed, batch=batch,
                   prompt_len=prompt_len,
                   new_tokens=new_tokens, tol=tol, tokens_equal=bool(torch.equal(seq_own, seq_lin)),
                   tokens_required=dtype == torch.float32)
        errs = {}
        if res["tokens_equal"]:
            errs["decode_vs_own"] = rel_rms(logits_lin, logits_own)
        if fp64:
            # every position of the linattn model's own tokens, without a cache: the chunked path over the whole
            # sequence, and the fp64 forward the cached decode steps must match
            inp = seq_lin[:, :-1]
            with torch.no_grad():
                full_lin = lin(inp).logits.float()
                with own_path():
                    full_own = own(inp).logits.float()
            full_ref = fp64_logits(own, inp)
            steps_ref = full_ref[:, prompt_len - 1:].transpose(0, 1)
            errs.update(forward_vs_own=rel_rms(full_lin, full_own), forward_vs_fp64=rel_rms(full_lin, full_ref),
                        decode_vs_fp64=rel_rms(logits_lin, steps_ref),
                        own_forward_vs_fp64=rel_rms(full_own, full_ref))
        res["errors"] = errs
        if dtype == torch.float32:
            res["bound"], res["checked"] = tol, [k for k in errs if k != "own_forward_vs_fp64"]
        else:
            res["bound"] = max(tol, 1.25 * errs["own_forward_vs_fp64"])
            res["checked"] = ["forward_vs_fp64", "decode_vs_fp64"]
        # transformers' own logits are themselves own_forward_vs_fp64 away from the fp64 ones (on a GPU with FLA
        # installed its path runs FLA's kernels, whose fp32 dots use TF32: ~3e-3): a comparison with them can
        # differ by that much on top of linattn's own error, so their bound is the tolerance plus that distance
        # (the comparisons with fp64 keep the plain tolerance)
        res["bound_vs_own"] = res["bound"] + errs.get("own_forward_vs_fp64", 0.0)
        res["passed"] = bool(res["checked"]) and all(
            errs[k] <= (res["bound_vs_own"] if k.endswith("_vs_own") else res["bound"]) for k in res["checked"]) and (
            res["tokens_equal"] or not res["tokens_required"])
        return res
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        lt.disable()
        if was_enabled:
            lt.enable()


def format_check(r: dict) -> str:
    """One line of a check_tiny_model result, ending in PASS or FAIL."""
    return (f"greedy tokens {'equal' if r['tokens_equal'] else 'DIFFER'}, relative RMS of the logits "
            + ", ".join(f"{k} {v:.2e}" for k, v in r["errors"].items())
            + f" (bound {r['bound']:.1e} on {', '.join(r['checked'])}; against transformers' own logits "
            + f"{r['bound_vs_own']:.1e}) -> {'PASS' if r['passed'] else 'FAIL'}")


# ------------------------------------------------------------------------------------------ the layer timing

def _median_ms(fn, device, reps, warmup):
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        from linattn.bench.timing import event_times_ms
        return statistics.median(event_times_ms(fn, reps))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _graph_ms(fn, device, reps):
    """Capture one call of fn in a CUDA graph (after warm-up calls on a side stream) and time its replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _median_ms(g.replay, device, reps, 3)


def _layers_under_test(dims, device, dtype, kind="gdn"):
    """linattn's GatedDeltaNet (kind "gdn") or KimiDeltaAttention ("kda"), and FLA's with the same weights when FLA
    imports ({"fla": error} otherwise)."""
    import linattn.layers
    name = "KimiDeltaAttention" if kind == "kda" else "GatedDeltaNet"
    layers, errors = {}, {}
    torch.manual_seed(0)
    lin = getattr(linattn.layers, name)(**dims, layer_idx=0).to(device=device, dtype=dtype)
    try:
        import fla.layers
        fla = getattr(fla.layers, name)(**dims, layer_idx=0).to(device=device, dtype=dtype)
        lin.load_state_dict(fla.state_dict())
        layers["fla"] = fla
    except Exception as e:                       # noqa: BLE001 - reported in the JSON, the linattn rows still run
        errors["fla"] = f"{type(e).__name__}: {str(e)[:300]}"
    layers["linattn"] = lin
    return layers, errors


def time_layer(device, dry_run=False, reps=20, warmup=5, kind="gdn", report=None) -> dict:
    """The training-step and decode-step rows of the layer of `kind` ("gdn": GatedDeltaNet, "kda":
    KimiDeltaAttention, the same sizes) against FLA's. report(row), where given, sees each row as it completes (FLA's
    first calls autotune for minutes, so a caller under a time limit keeps what finished)."""
    from linattn.layers import RecurrentCache
    dev = torch.device(device)
    dims = LAYER_DRY if dry_run else LAYER
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dry_run:
        reps, warmup = 1, 0
    layers, errors = _layers_under_test(dims, dev, dtype, kind)
    out = dict(kind=kind, layer=dims, dtype=str(dtype).replace("torch.", ""), errors=errors, train=[], decode=[])
    H = dims["hidden_size"]
    for B, T in (TRAIN_SHAPES_DRY if dry_run else TRAIN_SHAPES):
        x = torch.randn(B, T, H, device=dev, dtype=dtype, requires_grad=True)
        dy = torch.randn(B, T, H, device=dev, dtype=dtype)
        row = dict(B=B, T=T)
        first = {}
        for name, layer in layers.items():
            layer.train()

            def step(layer=layer):
                layer.zero_grad(set_to_none=True)
                x.grad = None
                y = layer(x)[0]
                y.backward(dy)
                return y
            try:
                first[name] = (step().detach(), x.grad.clone())
                row[f"{name}_ms"] = _median_ms(step, dev, reps, warmup)
            except Exception as e:               # noqa: BLE001
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "fla" in first and "linattn" in first:
            row["out_rel_rms_vs_fla"] = rel_rms(first["linattn"][0], first["fla"][0])
            row["dx_rel_rms_vs_fla"] = rel_rms(first["linattn"][1], first["fla"][1])
        out["train"].append(row)
        if report:
            report(row)
    for N in (DECODE_BATCHES_DRY if dry_run else DECODE_BATCHES):
        prompt = torch.randn(N, 16, H, device=dev, dtype=dtype)
        x1 = torch.randn(N, 1, H, device=dev, dtype=dtype)
        row = dict(batch=N)
        first = {}
        for name, layer in layers.items():
            layer.eval()
            try:
                with torch.no_grad():
                    cache = RecurrentCache()
                    layer(prompt, past_key_values=cache, use_cache=True)

                    def step(layer=layer, cache=cache):
                        return layer(x1, past_key_values=cache, use_cache=True)[0]
                    first[name] = step().clone()           # the first step after the same prefill: compared
                    row[f"{name}_eager_ms"] = _median_ms(step, dev, reps, warmup)
                    if dev.type == "cuda":
                        row[f"{name}_graph_ms"] = _graph_ms(step, dev, reps)
            except Exception as e:               # noqa: BLE001
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "fla" in first and "linattn" in first:
            row["out_rel_rms_vs_fla"] = rel_rms(first["linattn"], first["fla"])
        out["decode"].append(row)
        if report:
            report(row)
    out["note"] = ("decode: one step after a 16-token prefill into a RecurrentCache (FLA's cache protocol, used by "
                   "both layers); a graph replays one captured step (linattn updates its fp32 state in place, "
                   "FLA's op writes a new state tensor, so its replays repeat the same step: the same work)")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path of the JSON to write")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (Triton interpreter), no graphs")
    p.add_argument("--skip-model", action="store_true", help="only the layer timing")
    p.add_argument("--skip-layer", action="store_true", help="only the tiny-model check")
    p.add_argument("--kda", action="store_true", help="also time the KimiDeltaAttention layer (JSON key layer_kda)")
    args = p.parse_args(argv)
    from linattn.bench.env import collect_env, env_line
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        print("no CUDA device: run with --dry-run for the CPU form", file=sys.stderr)
        return 2
    env = collect_env(device)
    print(env_line(env), flush=True)
    result = dict(env=env, model=[], layer=None)
    ok = True

    def save():                                  # after every part: a run cut short keeps what finished
        with open(args.out, "w") as f:
            json.dump(dict(result, passed=bool(ok)), f, indent=1)
    if not args.skip_model:
        dtypes = (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16)
        for dtype in dtypes:
            # the dry run takes the quick form (tokens and step logits against transformers' own); the tests run
            # the full one
            try:
                r = (check_tiny_model(device, dtype, new_tokens=4, batch=1, prompt_len=12, fp64=False)
                     if args.dry_run else check_tiny_model(device, dtype))
            except Exception as e:               # noqa: BLE001 - reported; the layer timing still runs
                r = dict(dtype=str(dtype), passed=False, error=f"{type(e).__name__}: {str(e)[:500]}")
            result["model"].append(r)
            ok &= r["passed"]
            print(f"tiny Qwen3-Next {r['dtype']}: " + (r["error"] if "error" in r else format_check(r)), flush=True)
            save()
    kinds = ([] if args.skip_layer else [("layer", "gdn")]) + ([("layer_kda", "kda")] if args.kda else [])
    for key, kind in kinds:
        result[key] = time_layer(device, dry_run=args.dry_run, kind=kind,
                                 report=lambda row, kind=kind: print(kind, json.dumps(row), flush=True))
        for row in result[key]["train"] + result[key]["decode"]:
            ok &= "linattn_error" not in row
        if result[key]["errors"]:
            print(json.dumps(result[key]["errors"]), flush=True)
        save()
    result["passed"] = bool(ok)
    save()
    print("PASSED" if ok else "FAILED", "->", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
