#!/usr/bin/env bash
# kill -9 in the middle of a `--recipe auto --target-size` conversion, then `--resume`: it
# finishes, its files equal an uninterrupted run's byte for byte (safetensors shards, index,
# config.json), and no `.OUT.tmp-*` folder is left. Heavy on a 35B-shape slice: runs under
# flock /work/wt/heavy.lock (NOLOCK=1 when the caller holds it).
#   scripts/check_resume_kill.sh SRC [TOKENS]
# KILL_AT: an extended regex of the progress line after which the run is killed (default: the
# first layer of the candidate builds' pass, "search: 1/"); TARGET (default 20% of SRC's
# bytes), ROUNDING (default rtn), WORK (default SRC-resume).
set -euo pipefail
src=$1; tok=${2:-256}
here=$(cd "$(dirname "$0")/.." && pwd); text=$here/assets/text
py=${PY:-$here/.venv/bin/python}
work=${WORK:-$src-resume}; rm -rf "$work"; mkdir -p "$work"
bytes=$(python3 -c "import glob,os,sys; print(sum(os.path.getsize(f) for f in glob.glob(sys.argv[1] + '/*.safetensors')))" "$src")
args=(--recipe auto --target-size "${TARGET:-$((bytes / 5))}" --calib "$text/en.calib.txt"
      --calib "$text/zh.calib.txt" --calib "$text/code.calib.txt" --calib-tokens "$tok"
      --rounding "${ROUNDING:-rtn}")
export POCKET_MLX_PROGRESS_INTERVAL=0
lock=(flock /work/wt/heavy.lock); [ -n "${NOLOCK:-}" ] && lock=()
run() { "${lock[@]}" "$py" -m pocket_mlx convert "$src" "$@" "${args[@]}"; }
{ lscpu | grep -E 'Model name|^CPU\(s\)' ; uptime; echo "args: ${args[*]}"; } | tee "$work/log"
t=$(date +%s)
"${lock[@]}" /usr/bin/time -v "$py" -m pocket_mlx convert "$src" "$work/ref" "${args[@]}" \
  > "$work/ref.log" 2>&1
echo "uninterrupted: $(( $(date +%s) - t )) s, $(grep 'Maximum resident' "$work/ref.log" | xargs)" | tee -a "$work/log"
t=$(date +%s)
"${lock[@]}" bash -c 'exec "$0" -m pocket_mlx convert "$@"' "$py" "$src" "$work/out" "${args[@]}" \
  > "$work/killed.log" 2>&1 &
until grep -Eq "${KILL_AT:-search: 1/}" "$work/killed.log"; do
  kill -0 $! 2>/dev/null || { echo "finished before the kill point" | tee -a "$work/log"; exit 1; }
  sleep 1
done
pid=$(pgrep -f -n "pocket_mlx convert $src $work/out") && kill -9 "$pid"
wait $! || true
echo "killed after: $(grep -E "${KILL_AT:-search: 1/}" "$work/killed.log" | head -1)" | tee -a "$work/log"
ls -a "$work" | tee -a "$work/log"
run "$work/out" --resume > "$work/resumed.log" 2>&1
echo "killed + resumed: $(( $(date +%s) - t )) s; $(grep -m1 resuming "$work/resumed.log")" | tee -a "$work/log"
left=$(ls -a "$work" | grep -c '^\.out\.tmp-' || true)
echo "temporary folders left: $left" | tee -a "$work/log"
status=0
for f in "$work"/ref/*.safetensors "$work"/ref/model.safetensors.index.json "$work"/ref/config.json; do
  cmp -s "$f" "$work/out/$(basename "$f")" || { echo "DIFFERS: $(basename "$f")"; status=1; }
done
[ "$left" = 0 ] || status=1
echo "$( [ $status = 0 ] && echo PASS || echo FAIL ): same bytes, $(ls "$work"/ref/*.safetensors | wc -l) shards" | tee -a "$work/log"
exit $status
