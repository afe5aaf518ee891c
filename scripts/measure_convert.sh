#!/usr/bin/env bash
# Measure `pocket-mlx convert` on a 35B-shape slice (scripts/make_shape_checkpoint.py): peak RSS
# (/usr/bin/time -v, and per phase: scripts/phase_rss.py) and wall time, with the per-phase
# progress lines (plain, every 30 s; POCKET_MLX_PROGRESS_INTERVAL=0 for every step, which also
# puts each phase's peak in the right phase) kept in the log. Heavy: runs under flock
# /work/wt/heavy.lock (shared machine), one mode at a time (NOLOCK=1 when the caller already
# holds the lock for a batch).
#   scripts/measure_convert.sh SLICE_DIR MODE [TOKENS]   MODE: 2bit | reap | gptq | auto
# TOKENS: --calib-tokens (default 2048; "default": none given, the command's own defaults)
# auto: TARGET (default: 20% of the slice's bf16 bytes, ~3.2 bits per weight), ROUNDING
# (default: auto's own, gptq; rtn for the streamed search alone).
set -euo pipefail
src=$1; mode=$2; tok=${3:-2048}
here=$(cd "$(dirname "$0")/.." && pwd); text=$here/assets/text
out=$src-out-$mode; log=$src-$mode.log
case $mode in
  2bit) args=(--recipe pocket-2bit) ;;
  reap) args=(--recipe pocket-2bit --prune-to 128 --calib "$text/en.calib.txt") ;;
  gptq) args=(--recipe pocket-2bit --rounding gptq --calib "$text/en.calib.txt") ;;
  auto) bytes=$(python3 -c "import glob,os,sys; print(sum(os.path.getsize(f) for f in glob.glob(sys.argv[1] + '/*.safetensors')))" "$src")
        args=(--recipe auto --target-size "${TARGET:-$((bytes / 5))}" --calib "$text/en.calib.txt"
              --calib "$text/zh.calib.txt" --calib "$text/code.calib.txt")
        [ -n "${ROUNDING:-}" ] && args+=(--rounding "$ROUNDING") ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
[ "$mode" = 2bit ] || [ "$tok" = default ] || args+=(--calib-tokens "$tok")
export POCKET_MLX_PROGRESS_INTERVAL=${POCKET_MLX_PROGRESS_INTERVAL:-30}
{ lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-200; date -u; echo "args: ${args[*]}"; } > "$log"
lock=(flock /work/wt/heavy.lock); [ -n "${NOLOCK:-}" ] && lock=()  # NOLOCK: the caller holds it
"${lock[@]}" /usr/bin/time -v python3 "$here/scripts/phase_rss.py" -- timeout "${LIMIT:-2400}" \
  pocket-mlx convert "$src" "$out" --force "${args[@]}" >> "$log" 2>&1 || echo "exit $?" >> "$log"
grep -E 'Maximum resident|Elapsed|wrote|exit|error|peak RSS per phase| GB( \(VmHWM\))?$' "$log" || true
rm -rf "$out"
