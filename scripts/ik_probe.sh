#!/usr/bin/env bash
# S(n) of the default target and draft on llama.cpp, on ik_llama.cpp's wheel and, when given, on a native
# build of ik_llama.cpp (README, "A native build"): the numbers behind the README's Backends section and
# issue 14's native-build question. Run it on a quiet machine; each run prints the load average at its
# start and end, and wheel and native runs alternate so that a load change hits both.
#
#   scripts/ik_probe.sh [OUT_DIR] [NATIVE_LIBLLAMA_SO]
#   THREADS=2 ROUNDS=2 scripts/ik_probe.sh bench-out/ik-probe "$PWD/iksrc/build/src/libllama.so"
#
# Writes one text file per run into OUT_DIR (default bench-out/ik-probe) and prints them as they finish.
set -euo pipefail
out=${1:-bench-out/ik-probe}
native=${2:-}
threads=${THREADS:-2}
rounds=${ROUNDS:-2}
models=${MODELS:-qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct}  # known names or GGUF paths
mkdir -p "$out"
unset SPECDEC_IK_LIB

probe() {  # probe NAME MODEL BACKENDS [SPECDEC_IK_LIB]
  local name=$1 model=$2 backends=$3 lib=${4:-}
  local file="$out/$name.txt"
  echo "== $name" | tee -a "$file"
  SPECDEC_IK_LIB="$lib" python3 -m specdec.bench.probe --target "$model" --backends "$backends" \
    --threads "$threads" --repeats 5 --context 120 | tee -a "$file"
}

for model in $models; do
  tag=$(basename "$model" .gguf)
  probe "$tag-llama.cpp+ik-wheel" "$model" llama.cpp,ik
  for r in $(seq "$rounds"); do
    probe "$tag-ik-wheel" "$model" ik
    if [ -n "$native" ]; then
      probe "$tag-ik-native" "$model" ik "$native"
    fi
  done
done
echo "wrote $out/"
