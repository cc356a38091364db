"""Prefill speed of one GGUF backend configuration: the default target, the first summarization prompts of the
bench (the chat template applied), each evaluated in one backend call after a warm-up; prints a JSON line.

The library is chosen outside, by the environment, so that one process loads one build:
``SPECDEC_IK_LIB`` (an ik_llama.cpp ``libllama.so`` built here, see docs/backends.md, "A native build"),
``LLAMA_CPP_LIB_PATH`` (llama-cpp-python's own override: a folder with another ``libllama.so``) and
``SPECDEC_LLAMA_AMX=1`` (llama.cpp's AMX weight buffers on). ``run.sh`` runs every configuration in turn.

    python3 docs/bench/prefill/levers.py --backend ik [--flash-attn] [--n-batch 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["ik", "ik-shared", "llama.cpp"], default="ik",
                    help="ik: the default (exact numerics); ik-shared: ik_llama.cpp with one shared context; "
                         "llama.cpp: llama-cpp-python")
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="summarization prompts (default 2)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)

    from specdec.bench.prompts import load_prompts
    from specdec.models import resolve_model

    path = resolve_model("qwen2.5-coder-1.5b-instruct")
    common = dict(n_ctx=4096, n_seq_max=1, n_threads=args.threads, n_batch=args.n_batch, adaptive_threads=False)
    if args.backend == "llama.cpp":
        import llama_cpp

        from specdec.backends.llama_cpp import LlamaCppBackend, model_params

        backend = LlamaCppBackend(path, flash_attn=args.flash_attn, **common)
        info = llama_cpp.llama_print_system_info().decode()
        extra = bool(getattr(model_params(), "use_extra_bufts", False))
    else:
        from specdec.backends.ik_exact import IkExactBackend
        from specdec.backends.ik_llama_cpp import IkLlamaCppBackend, ik_library

        cls = IkExactBackend if args.backend == "ik" else IkLlamaCppBackend
        backend = cls(path, flash_attn=args.flash_attn, **common)
        lib = ik_library()
        info, extra = str(lib.system_info), None
    prompts = [p for p in load_prompts(per_category=args.prompts, categories=("summarization",))]
    ids = [backend.tokenize(backend.apply_chat_template([{"role": "user", "content": p.text}]), special=True)
           for p in prompts]
    s = backend.new_sequence()
    backend.eval({s: (ids[0][:64], 2)})  # warm-up
    backend.free_sequence(s)
    rates = []
    for _ in range(args.repeats):
        for toks in ids:
            s = backend.new_sequence()
            t0 = time.perf_counter()
            backend.eval({s: (toks, 2)})
            rates.append(len(toks) / (time.perf_counter() - t0))
            backend.free_sequence(s)
    print(json.dumps({"label": args.label, "backend": args.backend, "flash_attn": args.flash_attn,
                      "n_batch": args.n_batch, "threads": args.threads, "extra_buffers": extra,
                      "library": os.environ.get("SPECDEC_IK_LIB") or os.environ.get("LLAMA_CPP_LIB_PATH") or "package",
                      "amx_env": os.environ.get("SPECDEC_LLAMA_AMX"),
                      "avx512": "AVX512 = 1" in info, "amx": "AMX_INT8 = 1" in info,
                      "prompt_tokens": [len(t) for t in ids], "prefill_tok_s": [round(r, 1) for r in rates],
                      "median_tok_s": round(statistics.median(rates), 1), "load": os.getloadavg()[0]}), flush=True)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
