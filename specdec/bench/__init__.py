"""Benchmark runners, peers and reports.

``specdec bench`` (:mod:`~specdec.bench.runner`) runs real prompts (:mod:`~specdec.bench.prompts`:
Spec-Bench, HumanEval complete / code-edit) through every method, interleaved per prompt, against a raw
llama-cpp-python decoding loop (:mod:`~specdec.bench.raw`, the floor) and llama.cpp's own server
(:mod:`~specdec.bench.peer`), and writes JSON, a Markdown table and plots (:mod:`~specdec.bench.report`).
Nothing is imported here, so each runner loads only what it needs.
"""
