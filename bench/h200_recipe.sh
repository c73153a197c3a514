#!/usr/bin/env bash
# The GPU recipe on one 2-GPU machine (kind nvidia-h200-x2), in one device session: issue 12's larger data set
# and drafter, and issue 14's loss-curve comparison (2 GPUs vs 1 GPU with --grad-accum 2, and a 2-GPU run
# preempted and resumed on 1 GPU). Uses the step/bundle/b3 helpers of bench/h200_session.sh.
#
#   bash bench/h200_recipe.sh start     # after .gpu/1 is unpacked: set up, then run everything detached
#   bash bench/h200_recipe.sh status    # any later call: progress; results (and, once, the data) into $OUT
#
# R1 prompts on GPU 0 (ShareGPT every turn, Magpie, stdlib code; PROMPTS total) while B3 runs on both GPUs;
# R2 synth on both GPUs (the set split by line parity), each stopped after SYNTH_S seconds (a later session
#    resumes the rest: prompts and answers come back compressed through $OUT);
# R3 the drafter: online training on both GPUs (DDP) for TRAIN_BUDGET, export;
# R4 MT-bench (80 questions x 256 new tokens; vanilla, n-gram, chain 3, tree 8,8,60) at batch 1 on GPU 0, and
#    the same for a drafter trained on the first third of the conversations on GPU 1 (the scaling table).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/h200_session.sh" source
SYNTH_S=${SYNTH_S:-420}
TRAIN_BUDGET=${TRAIN_BUDGET:-360s}
PROMPTS=${PROMPTS:-30000}

data_out() {  # prompts + answers, xz-compressed, in 15 MB parts: they travel back once (status moves them)
  mkdir -p "$RUN/pack" && rm -f "$RUN"/pack/*
  (cd "$RUN" && tar cf - prompts.jsonl prompts.jsonl.provenance.json synth[0-9].jsonl synth[0-9].jsonl.* 2>/dev/null \
    | xz -T 16 -6 | split -b 15m -d -a 2 - pack/data.tar.xz.part)
  mv "$RUN"/pack/* "$RUN/out/"  # whole parts only: a status call never moves a part still being written
}

phase_r() {
  wait_assets
  local P="$RUN/prompts.jsonl"
  mkdir -p "$RUN/results" "$RUN/figs"
  # R1: prompts on GPU 0; B3 (small, on ShareGPT's own answers) on both GPUs meanwhile
  step r1_prompts env CUDA_VISIBLE_DEVICES=0 $HSTAP prompts --out "$P" --total "$PROMPTS" --source sharegpt:10 \
    --source magpie:12 --source code:8 --device cuda --batch-size 256 &
  b3 "train --online --model smollm2 --data sharegpt --limit 3000 --device cuda --ttt-steps 7 \
    --draft-vocab 16384 --batch-tokens 16384 --lr 2e-3 --max-steps 40 --checkpoint-every 10 --calib-prompts 0"
  wait
  bundle
  # R2: synth, split by line parity, time-boxed; `hstap synth` resumes where a run stopped
  awk 'NR % 2 == 0' "$P" > "$RUN/p0.jsonl"; awk 'NR % 2 == 1' "$P" > "$RUN/p1.jsonl"
  for g in 0 1; do
    step r2_synth_$g env CUDA_VISIBLE_DEVICES=$g PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      timeout -s INT "$SYNTH_S" $HSTAP synth --model smollm2 --data "jsonl:$RUN/p$g.jsonl" --turns all \
      --out "$RUN/synth$g.jsonl" --device cuda --batch-size 256 --max-new-tokens 384 &
  done
  wait
  cat "$RUN"/synth[0-9].jsonl > "$RUN/synth.jsonl"
  $PY - "$RUN/synth.jsonl" > "$RUN/results/synth_stats.json" <<'PYEOF'
import json, sys, collections
n, tokens, by = 0, 0, collections.Counter()
for line in open(sys.argv[1]):
    r = json.loads(line); n += 1; tokens += r.get("completion_tokens", 0)
    by[r.get("source") or str(r.get("id", "?")).split("-")[0]] += 1
print(json.dumps({"conversations": n, "completion_tokens": tokens, "by_source": by}))
PYEOF
  cp "$P.provenance.json" "$RUN/results/" 2>/dev/null
  local n; n=$(wc -l < "$RUN/synth.jsonl")
  head -n $((n / 3)) "$RUN/synth.jsonl" > "$RUN/synth_third.jsonl"
  data_out
  bundle
  # R3: the drafter on both GPUs; the one-third-data drafter on GPU 1 alongside (same steps budget)
  local T="train --online --model smollm2 --device cuda --ttt-steps 7 --draft-vocab 16384 --batch-tokens 32768 \
    --lr 2e-3 --epochs 30 --time-budget $TRAIN_BUDGET --calib-prompts 4"
  step r3_train $TR --nproc_per_node 2 -m hstap.cli $T --data "jsonl:$RUN/synth.jsonl" --out "$RUN/drafter" &
  step r3_train_third env CUDA_VISIBLE_DEVICES=1 $HSTAP $T --data "jsonl:$RUN/synth_third.jsonl" \
    --out "$RUN/drafter_third" &
  wait
  step r3_export $HSTAP export --drafter "$RUN/drafter" --format sglang --out "$RUN/export-sglang" --force
  # the drafter without the target's embedding, in bf16 (what a reference drafter would ship: ~29 MB)
  $PY - "$RUN/drafter" "$RUN/drafter_bf16" <<'PYEOF'
import sys, torch
from hstap.drafter import Eagle3Drafter
drafter = Eagle3Drafter.from_pretrained(sys.argv[1]).to(torch.bfloat16)
drafter.save_pretrained(sys.argv[2], include_embedding=False)
PYEOF
  mkdir -p "$RUN/pack" && rm -f "$RUN"/pack/*
  (cd "$RUN" && tar cf - drafter_bf16 drafter/metrics.jsonl drafter/train_config.json 2>/dev/null \
    | xz -T 16 -1 | split -b 15m -d -a 2 - pack/drafter.tar.xz.part)
  mv "$RUN"/pack/* "$RUN/out/"
  bundle
  # R4: MT-bench for both drafters, side by side on the two GPUs
  step r4_spec_b1 env CUDA_VISIBLE_DEVICES=0 $PY bench/spec_decode.py --drafter "$RUN/drafter" --device cuda \
    --dtype bf16 --batch 1 --log "$RUN/results/spec_b1.jsonl" &
  step r4_spec_third env CUDA_VISIBLE_DEVICES=1 $PY bench/spec_decode.py --drafter "$RUN/drafter_third" \
    --device cuda --dtype bf16 --batch 1 --log "$RUN/results/spec_third.jsonl" &
  wait
  for d in drafter drafter_third; do
    cp "$RUN/$d/metrics.jsonl" "$RUN/results/$d.metrics.jsonl" 2>/dev/null
    cp "$RUN/$d/config.json" "$RUN/results/$d.config.json" 2>/dev/null
  done
  cp "$RUN"/drafter/*.png "$RUN/figs/" 2>/dev/null
  bundle
  echo "$(date +%T) ALL DONE" >> "$RUN/progress"
}

case ${1:-status} in
  start)
    mkdir -p /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    nvidia-smi --query-gpu=index,name,memory.used --format=csv > "$RUN/logs/gpus.txt" 2>&1
    # run from a private copy: later calls replace this working tree, and bash reads a script as it goes
    rm -rf /tmp/hrepo && mkdir -p /tmp/hrepo && cp -r "$REPO"/hstap "$REPO"/bench "$REPO"/pyproject.toml /tmp/hrepo/
    setsid nohup bash -c "source /tmp/hrepo/bench/h200_recipe.sh source && phase_r" > "$RUN/logs/master.log" 2>&1 \
      < /dev/null &
    sleep 3; cat "$RUN/logs/gpus.txt" ;;
  status)
    cat "$RUN/progress" 2>/dev/null; tail -n 3 "$RUN/logs/master.log" 2>/dev/null
    bundle
    if [ -n "${OUT:-}" ]; then
      cp "$RUN"/out/results.tgz.part* "$OUT"/ 2>/dev/null
      for f in "$RUN"/out/data.* "$RUN"/out/drafter.*; do [ -f "$f" ] && mv "$f" "$OUT"/; done
    fi
    ls -la "$OUT" 2>/dev/null ;;
  source) ;;
esac
