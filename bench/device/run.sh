#!/usr/bin/env bash
# On the borrowed GPU machine (bench/README.md, "Device runs"): unpack what travelled in .device/, then run
# the sections named in $SECTIONS (default: env gpu_test shared emulation; also control, users), each under its own time limit,
# writing JSON and logs into $OUT. Every section runs even when an earlier one fails.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:?OUT names the folder whose files come back}
tree=/tmp/tree
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site/comfy_kitchen ]; then
  mkdir -p /tmp/site "$tree"
  python3 -m zipfile -e "$repo/.device/site.zip" /tmp/site
  tar -xzf "$repo/.device/tree.tar.gz" -C "$tree"
fi
export PYTHONPATH="$tree:/tmp/site:$repo/bench/device_site"
section() { echo "=== $1 ($(date -u +%T))"; }
for s in ${SECTIONS:-env gpu_test shared emulation}; do
  case $s in
    env)
      section env
      { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv
        python3 -c 'import torch, comfy_kitchen, comfy_aimdo; print(torch.__version__, torch.cuda.get_device_name(), torch.version.cuda)'
        nproc; free -g; df -h /tmp /dev/shm
        dd if=/dev/zero of=/tmp/dd.bin bs=16M count=128 oflag=direct 2>&1 | tail -1; rm -f /tmp/dd.bin
      } > "$out/env.txt" 2>&1
      cat "$out/env.txt" ;;
    gpu_test)
      section gpu_test
      (cd "$tree" && timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests-unit/comfy_extras_test/nodes_minimax_h3_parallel_gpu_test.py 2>&1 | tail -40 | tee "$out/gpu_test.log") ;;
    stream_path)
      section stream_path
      (cd "$tree" && timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests-unit/parallel_test/parallel_stream_path_test.py 2>&1 | tail -40 | tee "$out/stream_path_test.log") ;;
    shared)
      section shared
      (cd "$tree" && timeout ${SHARED_S:-240} python3 "$repo/bench/h3_shared_gpu.py" --out "$out/h3_gpu_shared.json" --ranks ${SHARED_RANKS:-2,4,8} --layers 2 ${SHARED_ARGS:-} 2>&1 | tail -30) ;;
    control)
      section control
      (cd "$tree" && timeout ${CONTROL_S:-240} python3 "$repo/bench/h3_shared_gpu.py" --out "$out/h3_gpu_controlnet.json" --ranks 2 --layers 2 --control --skip-link ${CONTROL_ARGS:-} 2>&1 | tail -10) ;;
    emulation)
      section emulation
      (cd "$tree" && timeout "${EMULATION_S:-400}" python3 "$repo/bench/h3_sp_emulation.py" --out "$out/h3_gpu_emulation.json" --latency-from "${LATENCY_FROM:-$out/h3_gpu_shared.json}" ${EMULATION_ARGS:-} 2>&1 | tail -100 > "$out/emulation.log"; tail -5 "$out/emulation.log") ;;
    vae)
      section vae
      (cd "$tree" && timeout "${VAE_S:-400}" python3 "$repo/bench/h3_vae_shared_gpu.py" --out "$out/h3_gpu_vae.json" ${VAE_ARGS:-} 2>&1 | grep -v "it/s" > "$out/vae.log"; tail -30 "$out/vae.log") ;;
    users)
      section users
      (cd "$repo" && timeout "${USERS_S:-540}" python3 "$repo/bench/h3_users_gpus.py" --tree "$tree" --dir /dev/shm --out "$out/h3_gpu_users.json" ${USERS_CONFIGS:+--configs $USERS_CONFIGS} 2>&1 | tail -40) ;;
  esac
done
echo "=== done ($(date -u +%T))"
