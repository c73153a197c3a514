#!/usr/bin/env bash
# `hstap capture` into a real full filesystem: a 20 MB tmpfs, 17 MB of it taken by a filler file (needs root).
#
#     sudo bash lab/disk_full_tmpfs.sh [/mnt/hstap-tmpfs]
#
# 1. refused up front by the estimate (exit 2, one line);
# 2. --force: the write that hits ENOSPC ends the run in one line (exit 2), no .tmp is left, the store verifies;
# 3. the filler is removed (space freed) and the same command resumes and completes the exact set.
# docs/reliability.md records a run.
set -u
MNT=${1:-/mnt/hstap-tmpfs}
HSTAP=${HSTAP:-.venv/bin/hstap}  # word-split on purpose: HSTAP="python -m hstap.cli" works
mkdir -p "$MNT"
mountpoint -q "$MNT" || mount -t tmpfs -o size=20m tmpfs "$MNT" || { echo "cannot mount a tmpfs on $MNT"; exit 1; }
rm -rf "${MNT:?}"/*
dd if=/dev/zero of="$MNT/filler" bs=1M count=17 status=none
OUT="$MNT/cap"
ARGS=(capture --limit 12 --max-tokens 128 --out "$OUT" --shard-mb 1)
step() { echo "== $*"; }

step "free before: $(df -B1 --output=avail "$MNT" | tail -1) bytes"
step "1. without --force"
$HSTAP "${ARGS[@]}" > "$MNT.log1" 2>&1; echo "exit $?"; tail -1 "$MNT.log1"
step "2. with --force"
$HSTAP "${ARGS[@]}" --force > "$MNT.log2" 2>&1; echo "exit $?"; tail -1 "$MNT.log2"
echo "left in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo ".tmp files: $(find "$OUT" -name '*.tmp' | wc -l); free: $(df -B1 --output=avail "$MNT" | tail -1) bytes"
$HSTAP store verify "$OUT"; echo "verify exit $?"
$HSTAP store info "$OUT" --json | python3 -c "import json,sys; d=json.load(sys.stdin); print('samples', d['samples'], 'shards', d['shards'])"
step "3. space freed (filler removed), same command"
rm "$MNT/filler"
$HSTAP "${ARGS[@]}" > "$MNT.log3" 2>&1; echo "exit $?"; grep -E "^(captured|resumed)" "$MNT.log3"
$HSTAP store verify "$OUT"; echo "verify exit $?"
$HSTAP store info "$OUT" --json | python3 -c "import json,sys; d=json.load(sys.stdin); print('samples', d['samples'], 'shards', d['shards'])"
