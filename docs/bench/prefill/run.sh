#!/usr/bin/env bash
# Every prefill lever measured here, in turn, two rounds (a machine shared with nothing else, please).
#   IK_NATIVE   an ik_llama.cpp libllama.so built for this CPU (docs/backends.md, "A native build")
#   LLAMA_FIXED a folder with llama.cpp's libraries built from llama-cpp-python's own sources with
#               CMAKE_CXX_FLAGS=-fno-dse (the AMX tile configuration survives GCC 12, see README.md here)
# Output: one JSON line per configuration and round on stdout.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-python3}"
uptime >&2
for round in 1 2; do
  "$py" "$here/levers.py" --backend ik --label "ik wheel (AVX2), exact"
  "$py" "$here/levers.py" --backend ik --flash-attn --label "ik wheel (AVX2), exact, flash attention"
  "$py" "$here/levers.py" --backend ik --n-batch 1024 --label "ik wheel (AVX2), exact, n_batch 1024"
  "$py" "$here/levers.py" --backend ik --threads 1 --label "ik wheel (AVX2), exact, 1 thread"
  if [ -n "${IK_NATIVE:-}" ]; then
    SPECDEC_IK_LIB="$IK_NATIVE" "$py" "$here/levers.py" --backend ik --label "ik native (AVX-512), exact"
    SPECDEC_IK_LIB="$IK_NATIVE" "$py" "$here/levers.py" --backend ik --flash-attn --label "ik native (AVX-512), exact, flash attention"
  fi
  "$py" "$here/levers.py" --backend llama.cpp --label "llama.cpp wheel, extra buffers off (specdec's default on AMX)"
  if [ -n "${LLAMA_FIXED:-}" ]; then
    LLAMA_CPP_LIB_PATH="$LLAMA_FIXED" SPECDEC_LLAMA_AMX=1 "$py" "$here/levers.py" --backend llama.cpp --label "llama.cpp -fno-dse, AMX buffers"
  fi
done
uptime >&2
