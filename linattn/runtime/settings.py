"""Every environment variable linattn reads, in one place.

TRITON_INTERPRET   Triton's own switch: run @triton.jit kernels on the CPU through the interpreter.
LINATTN_BACKEND    default backend for ops called with backend="auto" ("auto", "triton", "gluon", "reference").
LINATTN_LOG        "1" prints the backend choice and every rejection reason once per op and reason.
LINATTN_CHECK_INPUTS  "1" also checks the values of g and beta of GPU tensors (finite, g <= 0), at the cost of a
                   host synchronisation per call; CPU tensors are always checked. Read at import
                   (ops/gated_delta_rule/validation.py).
LINATTN_GDN_GLUON_VARIANT  state-pass variant of the GDN "gluon" backend: "literal", "tma" or "wgmma"
                   (default: "" = the launcher's default, the most advanced variant).
LINATTN_GLUON_HOST_CACHE  "0" turns off the host-path cache of the GDN Gluon state pass (launch plans per call
                   signature, descriptors cloned from a template, compiled-handle launch; gluon/launcher.py) and,
                   since round 24, of the fused forward's launches (the gate-free and W/U fused kernels and stage
                   2a through launcher.launches, their descriptors from templates), for A/B timing; read at import;
                   default on. Round 24 on an H200 (RESULTS.md round 24 part F): 70-91 us less host time per eager
                   forward (B1 T8192 271 vs 341 us, with segments 550 vs 641, B8 T4096 245 vs 323).
LINATTN_GDN_SPLIT_STATE   "1": the Triton GDN forward runs its state pass segment-parallel
                   (triton/chunk_state_split.py) where that helps; default off (the plain pass).
LINATTN_GDN_SPLIT_CHUNKS  segment length in chunks for the split state pass (default 0 = automatic); when set,
                   the split pass is taken for every shape while LINATTN_GDN_SPLIT_STATE=1.
LINATTN_GDN_FUSED_FWD     "1": the Triton GDN forward runs its state pass and output as one kernel
                   (triton/chunk_fused_fwd.py; h and vnew never stored) where its caller needs only o and the
                   final state; default off (stages 3 and 4 apart). Takes precedence over LINATTN_GDN_SPLIT_STATE.
LINATTN_GDN_GLUON_BWD_STATE  "1": the "gluon" backend's backward recomputes the forward's state pass with the Gluon
                   kernel, "0": with the Triton one; unset: Gluon where N*HV <= 64 sequence-heads (round 14 on an
                   H200, with the Gluon dh pass: backward 1.05x at B1 T8k/32k/64k, e.g. 13.70 -> 13.03 ms; flat at
                   B8 T4096, N*HV = 256, where the Gluon state pass is 0.92x Triton's; gluon/backend.py).
LINATTN_GDN_GLUON_BWD_DH  "0" makes the "gluon" backend's backward run its reverse state pass (stage 1: dh, dvnew's
                   state term, d initial_state) with the Triton kernel; default on: the Gluon TMA/wgmma kernel
                   (gluon/chunk_state_bwd.py). Round 14 on an H200: gate green (Triton kernel bit-equal up to 3e-5,
                   gradients vs fp64 autograd), backward 1.06-1.07x (B1 T65536 14.56 -> 13.57 ms),
                   benchmarks/GLUON_BWD_DH.md.
LINATTN_GDN_GLUON_FUSED_WS  "0" makes the "gluon" backend's forward run stages 3 and 4 (state pass and output)
                   apart; default on: one warp-specialised Gluon kernel (gluon/chunk_fused_ws.py; h and vnew never
                   stored) where the caller needs only o and the final state. Round 14 on an H200: gate green (o equal
                   to the unfused forward's), forward 1.23-1.39x (B1 T65536 3.62 -> 2.94 ms),
                   benchmarks/GLUON_FUSED_WS.md. Takes precedence over LINATTN_GDN_SEGMENT_WARMUP on that backend.
LINATTN_GDN_GLUON_FUSED_WU  "0" makes the "gluon" backend's forward form W and U in wu_kernel and run the fused-ws
                   kernel after it; default on: where the caller needs only o and the final state, W and U are formed
                   inside the warp-specialised fused kernel (gluon/chunk_fused_wu_ws.py; stage 2 is kkt_solve alone,
                   wu_kernel and the w/u buffers go away). Round 15 on an H200 (315dad4): gate green (o bit-equal to
                   the fused-ws forward's; Gluon gate with it forced), fused stages 1.05-1.30x faster than wu_kernel
                   + fused-ws at every production row (B1 T65536 2.305 -> 2.129 ms, B8 T4096 0.856 -> 0.668),
                   benchmarks/GLUON_FUSED_WU.md. Takes precedence over LINATTN_GDN_GLUON_FUSED_WS.
LINATTN_GDN_GLUON_WU_AREG "0" turns off, in the fused-wu kernel's BV=32 configs (B1-B2 at HV32), the W/U warpgroup's
                   register-A products: default on, it scales Tinv's columns by the gates in registers and multiplies
                   it as wgmma's register A operand against the ring's k and v tiles, with no scaled copy of k and v
                   through shared memory (round 16's ncu source view put ~57% of that warpgroup's time, the B1
                   chain's bound, in that copy). Round 16 on an H200 (3054c0e): Gluon gate 18/18 + grad + sync-free
                   with it; forward 1.05-1.08x at the BV=32 rows (B1 T65536 2.662 -> 2.510 ms); W and U round
                   Tinv * gates instead of k * gates (errors vs fp64 as before). BV=64 configs keep the copy (the
                   register-A form spills 24 bytes there).
LINATTN_GDN_GLUON_WU_AREG64 "0" keeps the fused-wu kernel's BV=64 configs (B >= 3 at HV32) on the scaled copy of k
                   and v; default on since round 17: WU_AREG there too, with the output / wu warpgroups at 136 / 192
                   registers (state 160; AOT 0 spill). Round 17 on an H200 (5fa92b3): Gluon gate 18/18 + grad +
                   sync-free with it; fused kernel 1.11-1.12x (B8 T4096 0.668 -> 0.597 ms, B4 T16384 1.327 -> 1.200,
                   varlen 1.270 -> 1.138).
LINATTN_GDN_GLUON_OUT_PIPE "0" turns off, in the fused-wu kernel's BV=32 WU_AREG config (B1-B2 at HV32), OUT_PIPE;
                   default on since round 17: the output warpgroup issues chunk c + 1's q k^T before chunk c's gate
                   work and exponentiates in log2 units by ex2.approx.ftz (chunk_fused_wu_ws._output_pipelined; output
                   / wu warpgroups at 160 / 160 registers, state 168). Round 17's ncu source view had that warpgroup
                   ~97% busy at B1, the chain's bound. On an H200 (5fa92b3): Gluon gate 18/18 + grad + sync-free with
                   it; fused kernel 1.16-1.18x (B1 T65536 1.969 -> 1.680 ms, B1 T8192 0.255 -> 0.219).
LINATTN_GDN_GLUON_BV16 "0" turns off BV=16 in the fused-wu kernel: default on since round 21, where even 16-column V
                   blocks fit the GPU in one wave (N * HV * V / 16 <= SMs: B1-B2 at H2/HV8), the kernel takes BV=16
                   (the BV=32 default's WU_AREG, OUT_PIPE, 160 / 160 registers, 3-stage ring; sm_90a 0 spill,
                   178,588 B shared) instead of BV=32 with most SMs idle; not in the segment-parallel forward's
                   launches. Round 21 on an H200 (493afea): Gluon gate green with it (two of its H2/HV8 cases
                   take BV=16), o and final state bit-equal to BV=32's, forward 1.045-1.057x at B1 T8192 / T32768 /
                   T65536 and B2 T32768 H2/HV8 (B1 T8192 0.244 -> 0.231 ms; FLA 0.237 in that table).
LINATTN_GDN_STATE_BV16 "0" turns off BV=16 in the Triton forward's state pass (triton/chunk_state.py; also the
                   backward's recompute): default on since round 21, where 32-column blocks leave SMs idle and
                   16-column ones still fit one wave (N * HV * V / 16 <= SMs: B1-B2 at H2/HV8), the Triton
                   counterpart of the fused-wu kernel's BV=16. Round 21 on an H200 (76de3a3): Triton forward gate
                   green with it, o and final state bit-equal to BV=32's, forward 1.094x / 1.100x / 1.100x at B1
                   T8192 / T32768 / T65536 and 1.047x at B2 T32768, H2/HV8.
LINATTN_GDN_STATE_DECAY_V "0" turns off, in the Triton forward's state pass, the decay on Vnew: default on since
                   round 21, each chunk's decay scales Vnew's rows (a [64, BV] scaling) instead of K's ([64, K], then a
                   transposed operand through shared memory) and K^T comes straight from the loaded tile: FLA's and
                   the fused Gluon kernel's form (chunk_state.state_update_vdecay). Rounding moves from K * decay to
                   Vnew * decay (o 1.3e-3 from the former, errors against fp64 within 1.04x of its over 40 CPU cases).
                   In the backward's recompute too since round 22 (LINATTN_GDN_STATE_DECAY_V_BWD). Round 21 on an
                   H200 (e60a30a): Triton forward gate green with it; the Triton forward 1.135x / 1.140x / 1.077x
                   at H2/HV8 B1 T8192 / B1 T65536 / B4 T16384, 1.081x / 1.026x at H16/HV32 B1 T65536 / B8 T4096.
LINATTN_GDN_STATE_DECAY_V_BWD "0" turns off the decay on Vnew in the Triton backward's recompute of the state pass
                   (with LINATTN_GDN_STATE_DECAY_V on): default on since round 22, so the gradients differentiate the
                   forward that runs. Round 22 on an H200 (3a4913e): Triton backward gate green with it; fwd+bwd
                   (Triton) 1.010x / 1.003x at H16/HV32 B1 T65536 / B8 T4096, 1.028x / 1.014x at H2/HV8 B1 T8192 /
                   B4 T16384 (same inputs, same process; gradients 1.3e-3 from the former's, o unchanged).
LINATTN_GDN_GLUON_OUT_PIPE64 "1" (opt-in, not a default): OUT_PIPE in the fused-wu kernel's BV=64 WU_AREG config
                   too, with the output / wu warpgroups at 152 / 176 registers (state 160; the only split without
                   spill). Round 18 on an H200 (3e157b5): gate green, fused kernel 1.05x at B8 T4096 but 0.97x at B4
                   T16384 and 0.98x varlen24 (benchmarks/OPT_LOG.md 18.1).
LINATTN_GDN_GLUON_GF128 unset (default since round 22): the gluon forward's fused-wu path runs stages 2b+3+4 at
                   BV = 128 in the gate-free form (gluon/chunk_fused_gf.py, benchmarks/GLUON_BV128.md: one CTA per
                   sequence and value head, Vnew = Tinv diag(beta) (V - diag(e^gam) K S), no W and no U, three
                   partitions) where V == 128, LINATTN_GDN_GLUON_SEGMENTS is off and the call has at least 15/16 of
                   a wave of sequence-heads (N * HV * 16 >= 15 * SMs: 124 on an H200); "1" takes it wherever V ==
                   128, "0" never. Round 22 on an H200 (83a788d): Gluon gate green with it forced on; forward 1.111x
                   / 1.074x / 1.094x at H16/HV32 B8 T4096 / B4 T16384 / varlen24, 1.107x / 1.096x at H16/HV64 B8
                   T4096 / B4 T16384; slower below the rule (0.871x at B2 T32768 HV32, 0.895x at H2/HV8 B8, ~0.45x at
                   B1), where fewer CTAs than SMs run its ~4 us chunk steps.
LINATTN_GDN_GLUON_GF_KS_PIPE unset (default since round 23): the gate-free kernel's state partition issues product
                   1's next column part before forming the current part's x (chunk_fused_gf.py KS_PIPE): with two
                   state partitions (the default since round 24) on both launches, with one (STATE2=0) on the plain
                   launch only (the output warpgroup then at 232 registers: sm_90a 0 spill); "1" both launches, "0"
                   neither. H200 round 23, one partition (gate green forced on, o and final bit-equal): 1.017x B8
                   T4096, 1.039x B4 T16384, 1.013x varlen24 at H16/HV32; the segment launch 0.989-1.001x, so off
                   there. Round 24, two partitions (RESULTS.md round 24 parts E and G, gate green forced on,
                   bit-equal): the segment launch 1.009-1.014x at all six rows (B1-B2 HV32, H2/HV8), the plain launch
                   0.996-1.006x.
LINATTN_GDN_GLUON_GF_STATE2 unset (default since round 24): the gate-free kernel runs its state chain in two state
                   partitions of 64 columns each (chunk_fused_gf.py STATE_WGS=2: each holds the [128, 64] half of S,
                   publishes its half, forms its half of x, vnew and d * vnew; the products at N = 32 / 64), four
                   warpgroups with the output at 176 and the worker state partition at 152 registers (sm_90a: 0
                   spill, wgmmas not serialised, in all four builds); "0": one state warpgroup (round 23's kernel);
                   "1": two. Round 24 on an H200 (benchmarks/OPT_LOG.md 24.1-24.2, RESULTS.md round 24 part B; gate
                   green with it forced on, o and final bit-equal): 1.113x B8 T4096, 1.133x B4 T16384, 1.125x
                   varlen24, 1.067x B1 T65536, 1.059x B1 T8192, 1.073x B2 T32768 at H16/HV32; 1.096x / 1.069x at
                   HV64 B8 / B4; 1.058x / 1.061x at H2/HV8 B1 T65536 / B8 T4096.
LINATTN_GDN_GLUON_GF_GATE_AT "0", "1", "2": where the gate-free kernel's state partitions issue the next chunk's
                   gate loads (chunk_fused_gf._gf_state GATE_AT: 0 the loop's top, 1 after S's publication, 2 after
                   x's fence; round 28: 1 0.89-0.97x, 2 0.99-1.02x, bit-equal); unset: chunk_fused_gf.GF_GATE_AT (0).
LINATTN_GDN_GLUON_GF_RELEASE_FENCE "0" / "1": without / with the fence before the gate-free kernel's state partitions
                   release their ring slot (chunk_fused_gf._gf_state RELEASE_FENCE; the fence after d * vnew's store
                   already follows every generic access to the slot); unset: chunk_fused_gf.GF_RELEASE_FENCE.
LINATTN_GDN_GLUON_GF_STATE_T "1" (opt-in, round 28): with two state partitions, the gate-free kernel's state chain
                   transposed (chunk_fused_gf._gf_state_t: each partition holds S^T, x^T and d * vnew^T are wgmma A
                   operands from registers instead of round trips through shared memory, the gates staged in shared
                   memory by the producer warp).
LINATTN_GDN_DECODE_VARIANT "+"-joined opt-in variants of the persistent decode kernel (fused_recurrent.py
                   PERSISTENT_VARIANTS) added to its default config where that config runs, e.g. "store_cs", or
                   "store_first" / "discard_l2" (round 29; discard_l2 only where it can run: in place, on a GPU, whole
                   128-byte lines); unset: fused_recurrent.DECODE_EXTRA_VARIANT (""). Since round 30 the default is
                   the reg_prefetch walk; a variant of the pipelined walk (fused_recurrent.PIPELINED_ONLY, e.g.
                   "prefetch_qk" alone) runs on the round-15 pipelined default instead.
LINATTN_GDN_DECODE_PDL "1" (opt-in, round 30) launches the Triton decode kernels with programmatic dependent
                   launch where it exists (CUDA sm_90+, a Triton with gdc_wait and launch_pdl;
                   fused_recurrent.pdl_refusal): each kernel waits (griddepcontrol.wait) for the stream's previous
                   kernel before its first global access, so its launch overlaps that kernel's end. Default off: on an
                   H200 it was flat at batch 1 and 32 and 0.3-0.8% slower at batch 256 (RESULTS.md round 30).
LINATTN_GDN_GLUON_DECODE_REG_STORE "1" (opt-in, round 29): the Gluon decode stores the new state from registers
                   by plain 16-byte stores instead of a TMA store from its ring slot, and refills the slot as soon as
                   the tile is in registers (gluon/decode.py REG_STORE); default off.
LINATTN_GDN_GLUON_GF_SEGMENTS unset (default since round 23): the gluon forward cuts each sequence of a fixed-length
                   batch whose sequence-heads leave SMs idle into as many segments as one wave of gate-free BV=128
                   CTAs holds (chunk_fused_gf.gf_segment_plan: B1 HV32 on 132 SMs, 4 segments; none shorter than 16
                   chunks), each started a gate-truncated warm-up early as LINATTN_GDN_GLUON_SEGMENTS's, and runs
                   them on the gate-free kernel (gluon/chunk_fused_gf.py, seg_ptr); the (sequence, head) pairs the
                   window kernel flags (slow decay) run unsegmented on the W/U kernel on a side stream. By default
                   only under CUDA-graph capture or from 32768 tokens (an eager call's host time: the path adds two
                   launches); "1" wherever the plan splits, "0" never. Not with LINATTN_GDN_GLUON_SEGMENTS=1 or
                   LINATTN_GDN_GLUON_GF128=0. Round 23 on an H200 (benchmarks/OPT_LOG.md 23.1-23.4, RESULTS.md
                   round 23 part D): B1-B2 HV32 forward 1.35-1.58x (B1 T65536 1.995 -> 1.266 ms), H2/HV8 B1 1.86x /
                   4.58x at T8192 / T65536; 0.993-1.009x where every head decays slowly, 0.994x at HV32 and 1.000x
                   at H2/HV8 where half do (those pairs run unsegmented).
LINATTN_GDN_GLUON_SEGMENTS "1" (opt-in, not a default): the gluon forward's fused-wu path cuts each sequence of a
                   fixed-length batch into segments of 64 chunks when the batch has too few sequence-heads to fill the
                   GPU at BV=64 (B1-B2 at HV32) and there are >= 4 segments, starts each segment's chain a
                   gate-truncated warm-up of <= 16 chunks early (error <= e^-20 of the state; triton/segment_start.py)
                   and runs the segments as sequences (FlashQLA's B1 scheme). A (sequence, head) whose window would be
                   longer, or whose window has a transition that is not a contraction (beta ||k||^2 outside [0, 2]),
                   runs unsegmented in a second launch on a side stream. Round 19 on an H200 (1a9384a, gate green,
                   same call as the forward without segments): 1.23-1.25x where every head decays fast (B1 T65536
                   2.151 -> 1.724 ms; 1.693 ms and 0.76x FlashQLA in the same-run table), but 0.981-0.99x where every
                   head decays slowly and 0.986x where half do: the chain of a slow head is the bound there, and the
                   window kernel and the segment launch next to it cost 1-2% (benchmarks/OPT_LOG.md 19.1-19.3). Why
                   not a default: the decision rule is faster at every timed row. Take it for long single sequences
                   whose gates decay fast on every head. Each segment's warm-up runs inside the fused kernel (round
                   18's Triton start-state kernel, slower at every measured row, was removed after round 19).
LINATTN_GDN_KKT           stage 2a (K K^T and the inverse Tinv, triton/intra_split.py) in the Triton forward, the
                   backward's recompute and the gluon forward. Default "v4" since round 20: kkt_solve_v4_kernel (v3
                   with bf16 operands for the inverse's products where Tinv is stored in bf16, i.e. the forward;
                   the backward's fp32 Tinv is v3's, bit-equal), its programs numbered head-fastest from 768 chunk
                   slots on (intra_split.kkt_order). Round 20 on an H200: stage 2a 0.442 -> 0.371 ms at B1 T65536
                   (0.317 with the head-fastest order), 0.215 -> 0.160 at B8 T4096; the forward 1.05-1.08x at every
                   production row; Gluon gate 18/18 + grad + sync-free and Triton forward gate green with both
                   (16ccb6b); bf16 Tinv error vs fp64 1.2-1.4x v3's. "v3": kkt_solve_v3_kernel (rounds 17-19: Tinv by
                   16x16 block substitution with TF32 warp-local products, cross-warp moves by broadcast and select);
                   "v2": kkt_solve_v2_kernel (round 16, with tl.gather); "v1": kkt_solve_kernel (a 64x64 block
                   inverse, before round 16).
LINATTN_GDN_GLUON_KKT     stage 2a of the gluon forward in Gluon (gluon/kkt_solve.py: one program per (chunk slot, key
                   head), the key tile by TMA, K K^T once per key head on warpgroup_mma, each value head's block
                   substitution as kkt_solve_v4_kernel's): "plain", "persist" (a persistent grid loading the next
                   item's key tile meanwhile), "shift", "split", "ftz" (plain with round 26's instruction cuts, each
                   on top of the one before: kkt_solve.FORMS), "early" (ftz with every value head's gate loads
                   issued before the wait on the key tile), "direct" (early, and a fixed-length batch's chunk bounds
                   by arithmetic instead of loads), unset / "1" (the default: "direct" since round 27, gate green
                   with it forced on, forward 1.007-1.022x over ftz, RESULTS.md round 27; "ftz" in round 26) or "0"
                   (off: the Triton kernel LINATTN_GDN_KKT picks). Falls back to Triton where gluon/kkt_solve.kkt_gluon_supported says
                   why (k not bf16 or not on a CUDA device, K != 128).
LINATTN_GDN_GLUON_KKT_MAXNREG  a register cap for that kernel (an integer; unset: the compiler's choice).
LINATTN_GDN_KKT_EARLY_K   "0" turns off, in kkt_solve_v4_kernel (stage 2a's default), EARLY_K: default on since round
                   21, the loads of g, beta and the k tile are issued together before gam's cumsum
                   (intra_split._chunk_a), where before k's were issued only after the cumsum had waited for g (two
                   dependent DRAM round trips per program; ~27% of v4's ncu samples at B1 T65536). Outputs bit-equal.
                   Round 21 on an H200 (1109770): stage 2a 1.08x (B1 T65536 0.318 -> 0.294 ms, B8 T4096 0.161 ->
                   0.150), forward 1.007-1.015x at all seven A/B rows; Gluon gate 18/18 + grad + sync-free and Triton
                   forward gate green with it.
LINATTN_GDN_SPLIT_INTRA   "0" turns off the two-kernel intra-chunk stage of the Triton GDN forward (A's inverse, then
                   W and U; triton/intra_split.py) and runs the one-kernel stage (triton/intra_chunk.py) instead;
                   default on since round 12 (H200: stage 2 1.32-1.47x, forward 1.09-1.18x, gate green).
LINATTN_GDN_SEGMENT_WARMUP "1": the Triton GDN forward runs its state pass in segments, each started from zero a
                   gate-chosen warm-up window before it (triton/chunk_state_warmup.py; an approximation, error <=
                   e^-20 of the state, benchmarks/SEGMENT_WARMUP.md); only for fixed-length batches with keys known
                   normalised (use_qk_l2norm_in_kernel or LINATTN_GDN_KEYS_NORMALISED=1) and >= 2 segments; default
                   off. Takes precedence over LINATTN_GDN_SPLIT_STATE.
LINATTN_GDN_BWD_WY        "v1" runs the Triton GDN backward's WY stage as before round 13 (triton/backward_wy.py,
                   8 warps); default "v2" (triton/backward_wy_v2.py: 4 warps, no spill, 2 CTAs/SM).
LINATTN_GDN_BWD_LOCAL     "v1" runs the backward's local stage as before round 13 (triton/backward_local.py);
                   default "v2" (triton/backward_local_v2.py). Round 13 on an H200: both v2 stages together take the
                   backward at B1 T65536 H16/HV32 from 18.63 to 14.62 ms, gate green.
LINATTN_GDN_OUTPUT        "v1" runs stage 4 of the Triton GDN forward as one K block with BV 64 at 4 warps (before
                   round 13); default "v2": the K-loop kernel at BK 64, BV 128, 8 warps, heads grouped
                   (triton/chunk_output.py; round 13: stage 4 1.32x at B1 T65536, 1.30x at B8 T4096).
LINATTN_GDN_KEYS_NORMALISED "1": the caller guarantees ||k|| = 1 (along K) and 0 <= beta <= 2 for every token, so
                   the GDN state transitions never expand (needed by LINATTN_GDN_SEGMENT_WARMUP without
                   use_qk_l2norm_in_kernel); default off.
"""
import os
from dataclasses import dataclass


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _on_off_auto(name: str) -> str:
    """A three-way switch: "auto" when unset (the code decides by shape), "on" for "1", "true", "yes" or "on", else
    "off"."""
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return "auto"
    return "on" if value in ("1", "true", "yes", "on") else "off"


def _on_unless_off(name: str) -> bool:
    """A switch that is on by default: "0", "off", "false" or "no" turns it off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


def _version(name: str, default: str = "v2") -> str:
    """A stage switch: "v1" (also "0", "off", "false", "no") selects the previous kernel, anything else the default."""
    value = os.environ.get(name, "").strip().lower()
    return "v1" if value in ("v1", "0", "off", "false", "no") else default


@dataclass(frozen=True)
class _Settings:
    @property
    def interpret(self) -> bool:
        return _flag("TRITON_INTERPRET")

    @property
    def default_backend(self) -> str:
        return os.environ.get("LINATTN_BACKEND", "auto")

    @property
    def log_choices(self) -> bool:
        return _flag("LINATTN_LOG")

    @property
    def check_inputs(self) -> bool:
        return _flag("LINATTN_CHECK_INPUTS")

    @property
    def gdn_gluon_variant(self) -> str:
        return os.environ.get("LINATTN_GDN_GLUON_VARIANT", "").strip().lower()

    @property
    def gluon_host_cache(self) -> bool:
        return os.environ.get("LINATTN_GLUON_HOST_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")

    @property
    def gdn_split_state(self) -> bool:
        return _flag("LINATTN_GDN_SPLIT_STATE")

    @property
    def gdn_fused_fwd(self) -> bool:
        return _flag("LINATTN_GDN_FUSED_FWD")

    @property
    def gdn_split_intra(self) -> bool:
        return os.environ.get("LINATTN_GDN_SPLIT_INTRA", "1").strip().lower() not in ("0", "false", "off", "no")

    @property
    def gdn_kkt(self) -> str:
        """"v4" (default since round 20: kkt_solve_v4_kernel, v3 with bf16 operands for the inverse's products where
        Tinv is stored in bf16; benchmarks/KKT_SOLVE.md), "v3" (LINATTN_GDN_KKT=v3: kkt_solve_v3_kernel, the default
        of rounds 17-19), "v2" (kkt_solve_v2_kernel, round 16's) or "v1" (kkt_solve_kernel, as before round 16). An
        unknown value is the default."""
        value = os.environ.get("LINATTN_GDN_KKT", "").strip().lower()
        return value if value in ("v1", "v2", "v3") else "v4"

    @property
    def gdn_gluon_kkt(self) -> str:
        """A gluon/kkt_solve.FORMS name (LINATTN_GDN_GLUON_KKT; unset, "1" or "on": kkt_solve.DEFAULT_FORM), or
        "off" ("0", anything else)."""
        value = os.environ.get("LINATTN_GDN_GLUON_KKT", "").strip().lower()
        from linattn.ops.gated_delta_rule.gluon.kkt_solve import DEFAULT_FORM, FORMS
        if value in ("", "1", "on"):
            return DEFAULT_FORM
        return value if value in FORMS else "off"

    @property
    def gdn_gluon_kkt_maxnreg(self):
        value = os.environ.get("LINATTN_GDN_GLUON_KKT_MAXNREG", "").strip()
        return int(value) if value.isdigit() and int(value) > 0 else None

    @property
    def gdn_kkt_early_k(self) -> bool:
        return _on_unless_off("LINATTN_GDN_KKT_EARLY_K")

    @property
    def gdn_gluon_bwd_state(self) -> str:
        """"on", "off" (LINATTN_GDN_GLUON_BWD_STATE set) or "auto" (unset: gluon/backend.py decides by shape)."""
        return _on_off_auto("LINATTN_GDN_GLUON_BWD_STATE")

    @property
    def gdn_gluon_bwd_dh(self) -> bool:
        return _on_unless_off("LINATTN_GDN_GLUON_BWD_DH")

    @property
    def gdn_gluon_fused_ws(self) -> bool:
        return _on_unless_off("LINATTN_GDN_GLUON_FUSED_WS")

    @property
    def gdn_gluon_fused_wu(self) -> bool:
        return _on_unless_off("LINATTN_GDN_GLUON_FUSED_WU")

    @property
    def gdn_gluon_wu_areg(self) -> bool:
        return _on_unless_off("LINATTN_GDN_GLUON_WU_AREG")

    @property
    def gdn_gluon_wu_areg64(self) -> bool:
        return _on_unless_off("LINATTN_GDN_GLUON_WU_AREG64")

    @property
    def gdn_gluon_out_pipe(self) -> bool:
        return _on_unless_off("LINATTN_GDN_GLUON_OUT_PIPE")

    @property
    def gdn_gluon_out_pipe64(self) -> bool:
        return _flag("LINATTN_GDN_GLUON_OUT_PIPE64")

    @property
    def gdn_state_bv16(self) -> bool:
        return _on_unless_off("LINATTN_GDN_STATE_BV16")

    @property
    def gdn_state_decay_v(self) -> bool:
        return _on_unless_off("LINATTN_GDN_STATE_DECAY_V")

    @property
    def gdn_state_decay_v_bwd(self) -> bool:
        return _on_unless_off("LINATTN_GDN_STATE_DECAY_V_BWD")

    @property
    def gdn_gluon_bv16(self) -> bool:
        return _on_unless_off("LINATTN_GDN_GLUON_BV16")

    @property
    def gdn_gluon_gf128(self) -> str:
        """"on", "off" (LINATTN_GDN_GLUON_GF128 set) or "auto" (unset: chunk_fused_gf.gf_wanted decides by shape)."""
        return _on_off_auto("LINATTN_GDN_GLUON_GF128")

    @property
    def gdn_gluon_gf_ks_pipe(self) -> str:
        """"on", "off" (LINATTN_GDN_GLUON_GF_KS_PIPE set) or "auto" (unset: the plain launch only)."""
        return _on_off_auto("LINATTN_GDN_GLUON_GF_KS_PIPE")

    @property
    def gdn_gluon_gf_state2(self) -> str:
        """"on", "off" (LINATTN_GDN_GLUON_GF_STATE2 set) or "auto" (unset: two state partitions, as "on")."""
        return _on_off_auto("LINATTN_GDN_GLUON_GF_STATE2")

    @property
    def gdn_gluon_gf_gate_at(self):
        """0, 1 or 2 (LINATTN_GDN_GLUON_GF_GATE_AT), or None (unset or anything else: chunk_fused_gf.GF_GATE_AT)."""
        value = os.environ.get("LINATTN_GDN_GLUON_GF_GATE_AT", "").strip()
        return int(value) if value in ("0", "1", "2") else None

    @property
    def gdn_gluon_gf_release_fence(self) -> str:
        """"on", "off" (LINATTN_GDN_GLUON_GF_RELEASE_FENCE set) or "auto" (unset: chunk_fused_gf.GF_RELEASE_FENCE)."""
        return _on_off_auto("LINATTN_GDN_GLUON_GF_RELEASE_FENCE")

    @property
    def gdn_gluon_decode_reg_store(self) -> bool:
        return _flag("LINATTN_GDN_GLUON_DECODE_REG_STORE")

    @property
    def gdn_decode_pdl(self) -> bool:
        """LINATTN_GDN_DECODE_PDL: "1" launches the decode kernels with programmatic dependent launch (opt-in)."""
        return _flag("LINATTN_GDN_DECODE_PDL")

    @property
    def gdn_decode_variant(self):
        """LINATTN_GDN_DECODE_VARIANT's "+"-joined variant names, or None when unset."""
        value = os.environ.get("LINATTN_GDN_DECODE_VARIANT")
        return None if value is None else value.strip()

    @property
    def gdn_gluon_gf_state_t(self) -> bool:
        return _flag("LINATTN_GDN_GLUON_GF_STATE_T")

    @property
    def gdn_gluon_gf_segments(self) -> str:
        """"on", "off" (LINATTN_GDN_GLUON_GF_SEGMENTS set) or "auto" (unset: chunk_fused_gf.GF_SEGMENTS_AUTO)."""
        return _on_off_auto("LINATTN_GDN_GLUON_GF_SEGMENTS")

    @property
    def gdn_gluon_segments(self) -> bool:
        return _flag("LINATTN_GDN_GLUON_SEGMENTS")

    @property
    def gdn_segment_warmup(self) -> bool:
        return _flag("LINATTN_GDN_SEGMENT_WARMUP")

    @property
    def gdn_keys_normalised(self) -> bool:
        return _flag("LINATTN_GDN_KEYS_NORMALISED")

    @property
    def gdn_bwd_wy(self) -> str:
        """"v2" (default since round 13) or "v1": which WY stage the Triton GDN backward runs."""
        return _version("LINATTN_GDN_BWD_WY")

    @property
    def gdn_bwd_local(self) -> str:
        """"v2" (default since round 13) or "v1": which local stage the Triton GDN backward runs."""
        return _version("LINATTN_GDN_BWD_LOCAL")

    @property
    def gdn_output(self) -> str:
        """"v2" (default since round 13: K loop, BV 128, 8 warps, heads grouped) or "v1" (one K block, BV 64)."""
        return _version("LINATTN_GDN_OUTPUT")

    @property
    def gdn_split_chunks(self) -> int:
        try:
            return max(0, int(os.environ.get("LINATTN_GDN_SPLIT_CHUNKS", "0") or 0))
        except ValueError:
            return 0


settings = _Settings()
