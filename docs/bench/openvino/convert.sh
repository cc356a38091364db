#!/usr/bin/env bash
# The default pair for OpenVINO GenAI: GGUF (specdec's cache) -> float32 Hugging Face checkpoint
# (transformers' GGUF loader dequantizes) -> int4 OpenVINO IR (optimum-intel, group size 128, as OpenVINO's
# own guides quantize LLMs for CPUs). Not the same weights as the GGUF files: OpenVINO runs its own int4.
#   PYTHON  a Python with openvino-genai, optimum-intel and transformers (default /tmp/ov-venv/bin/python)
#   OUT     where the models go (default /tmp/ov-models; ~7 GB while converting, 1.6 GB after; ~4.5 minutes)
set -euo pipefail
py="${PYTHON:-/tmp/ov-venv/bin/python}"
out="${OUT:-/tmp/ov-models}"
cache="$("$py" -c 'from specdec.models import cache_dir; print(cache_dir())')"
mkdir -p "$out"
cd "$out"
for size in 1.5b 0.5b; do
  name="qwen2.5-coder-$size-instruct"
  if [ -f "$name-ov/openvino_model.xml" ]; then
    continue  # converted already
  fi
  if [ ! -f "$name-hf/config.json" ]; then
    "$py" - "$cache" "$name" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
cache, name = sys.argv[1], sys.argv[2]
f = f"{name}-q4_k_m.gguf"
tok = AutoTokenizer.from_pretrained(cache, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(cache, gguf_file=f, dtype=torch.float32)
tok.save_pretrained(f"{name}-hf")
model.save_pretrained(f"{name}-hf")
PY
  fi
  if [ ! -f "$name-ov/openvino_model.xml" ]; then
    "$(dirname "$py")/optimum-cli" export openvino --model "$name-hf" --task text-generation-with-past \
      --weight-format int4 --group-size 128 "$name-ov"
  fi
  rm -rf "$name-hf"
done
echo "converted into $out"
