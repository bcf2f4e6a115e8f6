#!/usr/bin/env bash
# One lent GPU session's worth of checks, in parts that each fit a 10-minute command:
#
#   scripts/gpu-session.sh tests-a OUT   the GPU test suite (not slow) without the model, spec-round, tp 2 and
#                                        mailbox modules, log in OUT/tests-a/ (~90 s on one H200)
#   scripts/gpu-session.sh tests-b OUT   test_cuda_model.py's teacher-forced cases (one GPU), OUT/tests-b/
#   scripts/gpu-session.sh tests-b2 OUT  the rest of test_cuda_model.py (one GPU), OUT/tests-b2/
#   scripts/gpu-session.sh tests-c OUT   spec-round, tp 2 and mailbox modules (two GPUs), OUT/tests-c/
#                                        (every test part: at most 150 s per test, pytest-timeout)
#   scripts/gpu-session.sh decode OUT    one GPU: 27B decode (bf16, fp8, nvfp4) + prefill, 35B-A3B decode,
#                                        the decode-step profile, the quantised GEMV variants, speculation on the demo model
#   scripts/gpu-session.sh prefill OUT   one GPU: 27B prefill of 8k and 64k prompts, 35B-A3B prefill of 8k, an
#                                        8k prefill chunk's profile, the GDN rule's two forms per column count
#   scripts/gpu-session.sh context OUT   one GPU: 27B bf16 decode at 4k, 8k, 16k and 32k context, the decode
#                                        attention on tensor cores (default) and on the split kernel
#   scripts/gpu-session.sh t8 OUT        one GPU, ~5 min: the pipelined GEMV kernels' tests, then the 27B
#                                        fp8 / fp8-block / nvfp4 at C = 1, 4, 8 with auto's rule up to 8 columns
#                                        (the default) against the earlier 4 (GEMV variant pipe4)
#   scripts/gpu-session.sh c8 OUT        one GPU, ~2 min: where the 27B nvfp4 C = 8 step's excess over C = 1 goes
#                                        (C8/C1 1.36x against 1.3x): profile_step.py at C = 1 and 8 with dependent
#                                        launches off (kernel times then add up), side by side
#   scripts/gpu-session.sh dequant OUT   one GPU, ~5 min: the dequantisation kernel's tests (bit-exact, the prefill
#                                        path), its time per 27B layer against the copy floor and the prefill
#                                        linear against bf16 cuBLAS (linear.py --dequant), and the first tokens of
#                                        eight 64-token prompts submitted together (27B nvfp4, tp 1)
#   scripts/gpu-session.sh host OUT      one GPU, ~4 min: host time of eager steps: launch.py (per launch, both launch
#                                        routes alternated), then profile_step.py's kernel, wall and issue times of
#                                        27B nvfp4 prefill steps (1 and 6 prompts of 64 tokens), twice each
#   scripts/gpu-session.sh probe OUT     two GPUs, ~5 min: what the eighth session's analysis asks for first: the
#                                        quantised GEMV at every I-split (ks) on the 27B's main layers, and the
#                                        lean16 exchange with first-poll delays around half a PCIe round trip
#   scripts/gpu-session.sh ncu OUT       one GPU: Nsight Compute on the decode GEMV of the 27B's widest and
#                                        deepest layers (gate|up, down), bf16 / fp8 / nvfp4, T = 1 and 8, at the
#                                        timing runs' clocks; the key metrics per kernel last
#   scripts/gpu-session.sh gemm OUT      one GPU, ~8 min: the dequantising GEMM's tests (the weight ring among them),
#                                        linear.py per layer with the route's shapes and with the ring, the 27B step
#                                        at C = 16 / 32 / 64 (route, ring, GEMV), 27B nvfp4 speculation rounds
#   scripts/gpu-session.sh moe OUT       one GPU, ~4 min: the MoE kernel tests, the 35B-A3B C = 1 step's kernel times
#                                        (dependent launches off), decode.py 35B-A3B C = 1 / 8 with each of
#                                        $VARIANTS ("name:ENV=VALUE ...") alternated with the default
#   scripts/gpu-session.sh bf16pipe OUT  one GPU, ~5 min: bf16 launches of 3..8 columns on gemv_bf16_pipe for weights
#                                        up to TANDEM_GEMV_BF16_PIPE_ELEMS (32M / 100M / 600M elements) against
#                                        cuBLAS (the default), 35B-A3B C = 1 / 4 / 8 and 27B bf16 C = 4 / 8,
#                                        alternated (the measurement that set BF16_PIPE_ELEMS to 100M)
#   scripts/gpu-session.sh shard OUT     one GPU, ~6 min: issue 6's compute part without a second GPU: the 27B nvfp4
#                                        and bf16 decode step at C = 1 / 8 whole and as rank 0's shard of a tp 2
#                                        split with its all-reduces left out (decode.py --shard-of 2), and the
#                                        shard's kernel-time profile (tp 2 / tp 1 <= 0.6 needs the shard at
#                                        ~0.53x with ~0.6 ms of exchanges on top), and linear.py's nvfp4 GEMVs per
#                                        layer whole and halved (--shard-of 1 / 2)
#   scripts/gpu-session.sh prefix OUT    one GPU, ~8 min: the prefix cache and pre-quantised checkpoints (twentieth
#                                        session, CPU-tested only): their GPU tests (test_cuda_model.py -k
#                                        "resumed or pre_quantised"), then prefix_cache.py's agent loop on the
#                                        27B nvfp4 at 8k / 32k context (TTFT with the cache and without)
#   scripts/gpu-session.sh tp OUT        two GPUs: all-reduce latencies, tp 2 vs tp 1 (bf16 and nvfp4,
#                                        all-reduce share), a 27B tp 2 speculation round vs a plain step
#   scripts/gpu-session.sh engine OUT    two GPUs, ~3 min: the engine's step (27B nvfp4, tp 1 / 2, C = 1, 8) with
#                                        steps planned ahead and without, and where each step's host time goes
#   scripts/gpu-session.sh feed OUT      two GPUs, ~5 min: device-fed steps (EngineOptions.device_feed): their GPU
#                                        tests (bit-identical logits and no host sync; tp 1 / tp 2 ids), then
#                                        the engine's step (27B nvfp4, tp 1 / 2, C = 1, 8) fed and not: the
#                                        measurement that decides the feed's default at tp 2 (on at tp 1), and
#                                        the first real tp 2 / tp 1 ratio at C = 8 (earlier C = 8 engine rows
#                                        timed one lone sequence, docs/perf.md, eleventh session)
#
# Each part writes JSON files under OUT and prints a short table last. Timeouts keep every part
# inside its budget; a part that runs out reports what it finished.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: gpu-session.sh tests-a|tests-b|tests-b2|tests-c|decode|prefill|context|tp|engine|feed|t8|c8|dequant|host|probe|ncu|gemm|moe|bf16pipe|shard|prefix OUT}
OUT=${2:-out}
mkdir -p "$OUT"
B=scripts/bench
case "$PART" in
  tests-a|tests-b|tests-b2|tests-c)
    # the suite in four parts that each fit a command (test_cuda_model.py alone took 330-440 s for 12-31
    # of its 48 tests on the seventh session's two-GPU host)
    MODEL=tests/test_cuda_model.py
    HEAVY="$MODEL tests/test_cuda_spec_round.py tests/test_cuda_tp2.py tests/test_cuda_mailbox.py"
    SEL=()
    case "$PART" in
      tests-a)  FILES=$(grep -l "mark.gpu\|@gpu" tests/test_*.py | grep -v -F "$(printf '%s\n' $HEAVY)") ;;
      tests-b)  FILES=$MODEL; SEL=(-k "teacher_forced") ;;
      tests-b2) FILES=$MODEL; SEL=(-k "not teacher_forced") ;;
      tests-c)  FILES="tests/test_cuda_spec_round.py tests/test_cuda_tp2.py tests/test_cuda_mailbox.py" ;;
    esac
    timeout 560 scripts/gpu-tests.sh "$OUT/$PART" $FILES -m "gpu and not slow" "${SEL[@]}" --tb=short \
        --timeout=150 --durations=15 > "$OUT/$PART.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed|Timeout" "$OUT/$PART.txt" | cut -c1-200 | tail -25 ;;
  decode)
    timeout 170 python $B/decode.py --model 27b --weights bf16 fp8 nvfp4 --concurrency 1 4 8 16 32 \
        --prefill 8192 --steps 10 --out "$OUT/decode-27b.json" > "$OUT/decode-27b.txt" 2>&1
    timeout 110 python $B/decode.py --model 35b-a3b --weights bf16 --concurrency 1 8 --prefill --steps 10 \
        --variant pdlall:TANDEM_PDL=all \
        --out "$OUT/decode-35b.json" > "$OUT/decode-35b.txt" 2>&1
    timeout 60 python $B/profile_step.py --model 27b --top 12 --out "$OUT/profile.json" > "$OUT/profile.txt" 2>&1
    timeout 90 python $B/linear.py --variants --kinds fp8_row fp8_block nvfp4 --columns 1 4 8 \
        --out "$OUT/linear-variants.json" > "$OUT/linear.txt" 2>&1
    timeout 150 python $B/spec.py --draft-tokens 0 1 2 3 4 5 --concurrency 1 4 8 --new-tokens 64 \
        --out "$OUT/spec-demo.json" > "$OUT/spec-demo.txt" 2>&1
    for f in decode-27b decode-35b profile linear spec-demo; do echo "== $f"; tail -14 "$OUT/$f.txt"; done ;;
  prefill)
    timeout 150 python $B/decode.py --model 27b --weights bf16 --concurrency 1 --prefill 8192 65536 --steps 5 \
        --out "$OUT/prefill-27b.json" > "$OUT/prefill-27b.txt" 2>&1
    timeout 90 python $B/decode.py --model 35b-a3b --weights bf16 --concurrency 1 --prefill 8192 --steps 5 \
        --out "$OUT/prefill-35b.json" > "$OUT/prefill-35b.txt" 2>&1
    timeout 90 python $B/profile_step.py --model 27b --layers 8 --prefill 8192 --reps 2 --top 12 \
        --out "$OUT/profile-prefill.json" > "$OUT/profile-prefill.txt" 2>&1
    timeout 60 python $B/gdn_prefill.py --out "$OUT/gdn.json" > "$OUT/gdn.txt" 2>&1
    for f in prefill-27b prefill-35b profile-prefill gdn; do echo "== $f"; tail -14 "$OUT/$f.txt"; done ;;
  context)
    # the decode attention's two kernels by context length (TC_DECODE_MIN_LEN in ranks/model_cuda.py)
    for L in 4096 8192 16384 32768; do
      timeout 130 python $B/decode.py --model 27b --weights bf16 --concurrency 1 8 --steps 6 --prefill \
          --context $L --variant split:TANDEM_DECODE_ATTENTION=split --out "$OUT/decode-$L.json" > "$OUT/decode-$L.txt" 2>&1
      echo "== context $L"; grep -A5 "^weights variant" "$OUT/decode-$L.txt"
    done ;;
  tp)
    timeout 120 python $B/allreduce.py --out "$OUT/allreduce.json" > "$OUT/allreduce.txt" 2>&1
    timeout 300 python $B/decode_tp.py --model 27b --weights nvfp4 --tp 1 2 --transport mailbox nccl --share \
        --concurrency 1 8 --new-tokens 32 --out "$OUT/decode-tp-nvfp4.json" > "$OUT/decode-tp.txt" 2>&1
    timeout 150 python $B/spec.py --model 27b --tp 2 --draft-tokens 0 3 --concurrency 1 --new-tokens 64 \
        --rounds gpu eager --out "$OUT/spec-27b-tp2.json" > "$OUT/spec-27b.txt" 2>&1
    for f in allreduce decode-tp spec-27b; do echo "== $f"; tail -14 "$OUT/$f.txt"; done ;;
  engine)
    timeout 170 python $B/decode_tp.py --model 27b --weights nvfp4 --tp 1 2 --transport mailbox --concurrency 1 8 \
        --new-tokens 48 --out "$OUT/engine-ahead.json" > "$OUT/engine-ahead.txt" 2>&1
    timeout 170 python $B/decode_tp.py --model 27b --weights nvfp4 --tp 1 2 --transport mailbox --concurrency 1 8 \
        --new-tokens 48 --no-overlap-steps --out "$OUT/engine-plain.json" > "$OUT/engine-plain.txt" 2>&1
    for f in engine-ahead engine-plain; do echo "== $f"; grep -E "tp [12] " "$OUT/$f.txt" | cut -c1-260; done ;;
  feed)
    timeout 200 scripts/gpu-tests.sh "$OUT/feed-tests" tests/test_cuda_model.py tests/test_cuda_tp2.py \
        -m "gpu and not slow" -k "device_fed" --tb=short --timeout=150 > "$OUT/feed-tests.txt" 2>&1
    timeout 300 python $B/decode_tp.py --model 27b --weights nvfp4 --tp 1 2 --transport mailbox --concurrency 1 8 \
        --new-tokens 48 --device-feed --out "$OUT/engine-feed.json" > "$OUT/engine-feed.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed|Timeout" "$OUT/feed-tests.txt" | cut -c1-200 | tail -12
    echo "== engine-feed"; grep -E "tp [12] " "$OUT/engine-feed.txt" | cut -c1-280 ;;
  gemm)
    # the dequantising GEMM's open questions (fifteenth session): the weight ring (fp8 ring launches
    # unverified), the ring per layer, the step with and without it, and quantised speculation rounds
    timeout 120 scripts/gpu-tests.sh "$OUT/gemm-tests" tests/test_cuda_linear.py -m "gpu and not slow" -k "gemm" \
        --tb=short > "$OUT/gemm-tests.txt" 2>&1
    for sh in reg auto; do
      TANDEM_GEMV_MM=all TANDEM_GEMM_SHAPE=$sh timeout 40 python $B/linear.py --layers q_proj o_proj gate_up down \
          --kinds nvfp4 fp8_row --columns 16 32 64 --out "$OUT/gemm-linear-$sh.json" > "$OUT/gemm-linear-$sh.txt" 2>&1
    done
    timeout 150 python $B/decode.py --model 27b --weights nvfp4 fp8 --concurrency 16 32 64 --steps 6 \
        --variant reg:TANDEM_GEMM_SHAPE=reg --variant gemv:TANDEM_GEMV_MM=0 --out "$OUT/gemm-decode.json" \
        > "$OUT/gemm-decode.txt" 2>&1
    timeout 150 python $B/spec.py --model 27b --weights nvfp4 --draft-tokens 0 3 --concurrency 1 4 8 --new-tokens 48 \
        --out "$OUT/gemm-spec.json" > "$OUT/gemm-spec.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed|Timeout" "$OUT/gemm-tests.txt" | cut -c1-200 | tail -6
    for sh in reg auto; do echo "== shape $sh"; grep -E "^(gate|down|q_p|o_p)" "$OUT/gemm-linear-$sh.txt" | cut -c1-60; done
    grep -A14 "^weights variant" "$OUT/gemm-decode.txt" | cut -c1-120
    tail -8 "$OUT/gemm-spec.txt" | cut -c1-150 ;;
  t8)
    # auto's pipelined-kernel rule up to 8 columns (twelfth session) against the earlier 4 (pipe4)
    timeout 150 scripts/gpu-tests.sh "$OUT/t8-tests" tests/test_cuda_linear.py -m "gpu and not slow" -k "pipe" \
        --tb=short > "$OUT/t8-tests.txt" 2>&1
    timeout 300 python $B/decode.py --model 27b --weights fp8 fp8-block nvfp4 --concurrency 1 4 8 --steps 10 \
        --variant pipe4:TANDEM_GEMV_VARIANT=pipe4 --out "$OUT/t8-decode.json" > "$OUT/t8-decode.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed|Timeout" "$OUT/t8-tests.txt" | cut -c1-200 | tail -6
    grep -A20 "^weights variant" "$OUT/t8-decode.txt" | cut -c1-120 ;;
  c8)
    for C in 1 8; do
      TANDEM_PDL=0 timeout 100 python $B/profile_step.py --model 27b --weights nvfp4 --concurrency $C --top 40 \
          --out "$OUT/profile-c$C.json" > "$OUT/profile-c$C.txt" 2>&1
    done
    python - "$OUT/profile-c1.json" "$OUT/profile-c8.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ka, kb = a["kernels"], b["kernels"]
print(f"kernel time per step: C=1 {a['total_ms']:.2f} ms, C=8 {b['total_ms']:.2f} ms")
for name in sorted(set(ka) | set(kb), key=lambda n: -(kb.get(n, 0) - ka.get(n, 0)))[:16]:
    print(f"{kb.get(name, 0) - ka.get(name, 0):+8.3f} ms  {ka.get(name, 0):7.3f} -> {kb.get(name, 0):7.3f}  {name[:70]}")
PY
    ;;
  dequant)
    timeout 150 scripts/gpu-tests.sh "$OUT/dequant-tests" tests/test_cuda_linear.py -m "gpu and not slow" \
        -k "dequantize or prefill" --tb=short > "$OUT/dequant-tests.txt" 2>&1
    timeout 150 python $B/linear.py --dequant --kinds fp8_row fp8_block nvfp4 --columns 449 \
        --out "$OUT/dequant.json" > "$OUT/dequant.txt" 2>&1
    timeout 250 python $B/decode_tp.py --model 27b --weights nvfp4 --tp 1 --transport mailbox --concurrency 8 \
        --new-tokens 16 --out "$OUT/ttft.json" > "$OUT/ttft.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed|Timeout" "$OUT/dequant-tests.txt" | cut -c1-200 | tail -6
    echo "== dequant"; tail -12 "$OUT/dequant.txt" | cut -c1-150
    echo "== 8 x 64-token prompts submitted together (decode_tp.py prints their first tokens)"
    grep -E "tp 1 |first tokens" "$OUT/ttft.txt" | cut -c1-200
    ;;
  host)
    timeout 60 python $B/launch.py --launches 20000 --out "$OUT/launch.json" > "$OUT/launch.txt" 2>&1
    for rep in 1 2; do for C in 1 6; do
      timeout 80 python $B/profile_step.py --model 27b --weights nvfp4 --prefill 64 --concurrency $C --top 5 \
          --out "$OUT/host-c$C-$rep.json" > "$OUT/host-c$C-$rep.txt" 2>&1
    done; done
    tail -5 "$OUT/launch.txt"
    grep -h "wall" "$OUT"/host-c*.txt | cut -c1-200 ;;
  probe)
    timeout 170 python $B/linear.py --ks 1 2 4 8 --kinds nvfp4 fp8_row --columns 1 8 \
        --layers q_proj in_proj_qkv gate_up down --out "$OUT/linear-ks.json" > "$OUT/linear-ks.txt" 2>&1
    timeout 120 python $B/allreduce.py --sizes 4,10240,40960 \
        --mailbox-variants classic,lean16d300,lean16d500,lean16d700,lean16d900 \
        --out "$OUT/allreduce-delay.json" > "$OUT/allreduce-delay.txt" 2>&1
    for f in linear-ks allreduce-delay; do echo "== $f"; tail -24 "$OUT/$f.txt" | cut -c1-200; done ;;
  ncu)
    # ncu locks the SM clock to base unless told otherwise (1.36 GHz on an H200 against 1.98 in the
    # benches: docs/perf.md, eighth session)
    timeout 400 ncu --clock-control none --kernel-name regex:gemv_ --section SpeedOfLight --section SchedulerStats \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        python $B/linear.py --once --layers gate_up down --kinds bf16 fp8_row nvfp4 --columns 1 8 \
        > "$OUT/ncu.txt" 2>&1
    grep -E "^(gate_up|down) |^  gemv_|Duration|DRAM Throughput|One or More Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Waves Per SM" \
        "$OUT/ncu.txt" | cut -c1-150 ;;
  moe)
    # the 35B-A3B C = 1 step by kernel (dependent launches off, so times add up: the evidence the
    # seventeenth session relied on, where step times moved by up to 8% between identical settings), then
    # decode.py with $VARIANTS (e.g. "x:TANDEM_FOO=1") each followed by the default again (againN, an
    # environment variable nothing reads); the MoE kernel tests first
    timeout 120 scripts/gpu-tests.sh "$OUT/moe-tests" tests/test_cuda_misc.py -m "gpu and not slow" -k moe \
        --tb=short --timeout=100 > "$OUT/moe-tests.txt" 2>&1
    TANDEM_PDL=0 timeout 60 python $B/profile_step.py --model 35b-a3b --top 16 --out "$OUT/profile-35b.json" \
        > "$OUT/profile-35b.txt" 2>&1
    VARS=(); i=0
    for v in ${VARIANTS:-}; do i=$((i + 1)); VARS+=(--variant "$v" --variant "again$i:TANDEM_BENCH_REPEAT=$i"); done
    timeout 150 python $B/decode.py --model 35b-a3b --weights bf16 --concurrency 1 8 --prefill --steps 10 \
        "${VARS[@]}" --out "$OUT/decode-35b.json" > "$OUT/decode-35b.txt" 2>&1
    grep -E "passed|failed" "$OUT/moe-tests.txt" | tail -2
    head -18 "$OUT/profile-35b.txt"; grep -A12 "^weights variant" "$OUT/decode-35b.txt" ;;
  shard)
    timeout 200 python $B/decode.py --model 27b --weights nvfp4 bf16 --concurrency 1 8 --steps 8 --prefill \
        --out "$OUT/shard-whole.json" > "$OUT/shard-whole.txt" 2>&1
    timeout 150 python $B/decode.py --model 27b --weights nvfp4 bf16 --concurrency 1 8 --steps 8 --prefill \
        --shard-of 2 --out "$OUT/shard-2.json" > "$OUT/shard-2.txt" 2>&1
    TANDEM_PDL=0 timeout 60 python $B/profile_step.py --model 27b --weights nvfp4 --shard-of 2 --top 14 \
        --out "$OUT/shard-prof.json" > "$OUT/shard-prof.txt" 2>&1
    for n in 1 2; do                                  # the nvfp4 GEMVs per layer, whole and halved
      timeout 90 python $B/linear.py --variants --kinds nvfp4 --columns 1 8 --shard-of $n \
          --out "$OUT/shard-linear-$n.json" > "$OUT/shard-linear-$n.txt" 2>&1
    done
    grep -A5 "^weights variant" "$OUT/shard-whole.txt" "$OUT/shard-2.txt"; head -16 "$OUT/shard-prof.txt"
    grep -h -A3 "^All layers" "$OUT/shard-linear-1.txt" "$OUT/shard-linear-2.txt" ;;
  bf16pipe)
    # 35B-A3B: every bf16 layer but the lm_head (32M), then with it (600M); 27B: o_proj (32M), then q_proj,
    # in_proj and down too (100M); each followed by the default again
    timeout 150 python $B/decode.py --model 35b-a3b --weights bf16 --concurrency 1 4 8 --steps 10 \
        --variant p32:TANDEM_GEMV_BF16_PIPE_ELEMS=33554432 --variant again1:TANDEM_BENCH_REPEAT=1 \
        --variant p600:TANDEM_GEMV_BF16_PIPE_ELEMS=629145600 --variant again2:TANDEM_BENCH_REPEAT=2 \
        --out "$OUT/bf16pipe-35b.json" > "$OUT/bf16pipe-35b.txt" 2>&1
    timeout 200 python $B/decode.py --model 27b --weights bf16 --concurrency 4 8 --steps 8 \
        --variant p32:TANDEM_GEMV_BF16_PIPE_ELEMS=33554432 --variant again1:TANDEM_BENCH_REPEAT=1 \
        --variant p100:TANDEM_GEMV_BF16_PIPE_ELEMS=104857600 --variant again2:TANDEM_BENCH_REPEAT=2 \
        --out "$OUT/bf16pipe-27b.json" > "$OUT/bf16pipe-27b.txt" 2>&1
    grep -A15 "^weights variant" "$OUT/bf16pipe-35b.txt"; grep -A10 "^weights variant" "$OUT/bf16pipe-27b.txt" ;;
  prefix)
    timeout 300 scripts/gpu-tests.sh "$OUT/prefix-tests" tests/test_cuda_model.py -m gpu \
        -k "resumed or pre_quantised or inside_a_prefill" --tb=short --timeout=150 > "$OUT/prefix-tests.txt" 2>&1
    timeout 300 python $B/prefix_cache.py --device cuda --model 27b --weights nvfp4 --context 8000 32000 \
        --turns 4 --turn-tokens 300 --one-shot 3 --cut-too --out "$OUT/prefix.json" > "$OUT/prefix.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/prefix-tests.txt" | tail -8; cat "$OUT/prefix.txt" | tail -4 ;;
  *) echo "unknown part $PART (tests-a, tests-b, tests-b2, tests-c, decode, prefill, context, tp, engine, feed, t8, c8, dequant, host, probe, ncu, gemm, moe, bf16pipe, shard, prefix)" >&2; exit 2 ;;
esac
