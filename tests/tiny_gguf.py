"""Write tiny random-weight ``qwen2`` GGUF models for tests.

The models are small enough to build and load in milliseconds, yet exercise the real llama.cpp code
paths: byte-level BPE tokenizer with merges, ChatML control tokens, grouped-query attention with
q/k/v biases, RoPE, SwiGLU. Weights are float32 so that batched and one-token evaluation agree to
~1e-5. The vocabulary depends only on ``extra_vocab``, never on ``seed``: two seeds give two different
models that can serve as draft and target for each other.

This module knows nothing about specdec; it only writes files.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens, appended after every normal token in this order (eos/bos = ``<|endoftext|>``)."""

MERGES = (
    "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "e r", "Ġ s", "a t", "Ġ w", "o r", "e n",
    "Ġ o", "e s", "l l", "Ġ c", "i s", "a n", "e d", "Ġt he", "Ġ b", "i t", "Ġ f", "in g",
)
"""A few common English byte-pair merges (GPT-2 byte symbols; ``Ġ`` is the space byte)."""

QWEN2_5_TEMPLATE = (Path(__file__).parent / "qwen2_5_chat_template.jinja").read_text(encoding="utf-8")
"""Qwen2.5-Instruct's chat template (from the default pair's GGUF): renders ``tools`` and tool calls."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bytes_to_unicode() -> list[str]:
    """GPT-2's 256 byte symbols, in the order of GPT-2's ``bytes_to_unicode`` (token id order).

    Returns:
        ``[256] str``: entry i is the printable symbol of the i-th byte in GPT-2's order (``!`` first).
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tiny_vocab(extra_vocab: int = 0, pad_vocab: int = 0, pad_inside: bool = False) -> tuple[list[str], list[int], list[str]]:
    """The tiny models' vocabulary.

    Args:
        extra_vocab: Extra normal tokens appended before the control tokens.
        pad_vocab: Padding tokens (``[PADi]``, gguf type unused) appended after the control tokens, as
            Qwen's GGUFs have them (151,665 real tokens in 151,936 rows).
        pad_inside: Put the padding tokens before the control tokens instead (real ids after padding).

    Returns:
        ``(tokens, token_types, merges)``: token texts, gguf token types (1 normal, 3 control, 5 unused)
        and the BPE merges.
    """
    tokens = bytes_to_unicode()
    tokens += [a + b for a, b in (m.split(" ") for m in MERGES)]
    tokens += [f"<x{i}>" for i in range(extra_vocab)]
    assert len(set(tokens)) == len(tokens)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    pads, pad_types = [f"[PAD{i}]" for i in range(pad_vocab)], [gguf.TokenType.UNUSED] * pad_vocab
    control, control_types = list(CONTROL_TOKENS), [gguf.TokenType.CONTROL] * len(CONTROL_TOKENS)
    if pad_inside:
        tokens, types = tokens + pads + control, types + pad_types + control_types
    else:
        tokens, types = tokens + control + pads, types + control_types + pad_types
    return tokens, [int(t) for t in types], list(MERGES)


def write_tiny_qwen2_gguf(
    path: str | Path,
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx: int = 512,
    extra_vocab: int = 0,
    pad_vocab: int = 0,
    pad_inside: bool = False,
    chat_template: bool | str = True,
    scale: float = 2.5,
    perturb: float = 0.0,
    perturb_seed: int = 12345,
) -> Path:
    """Write a random-weight qwen2 GGUF model (float32 tensors) and return its path.

    Args:
        path: Output file.
        seed: Seed of the weights; the vocabulary does not depend on it.
        n_layer: Transformer blocks.
        n_embd: Hidden size; must be divisible by ``n_head``.
        n_head: Query heads.
        n_head_kv: Key/value heads (grouped-query attention); must divide ``n_head``.
        n_ff: Feed-forward size.
        n_ctx: Training context length written to the metadata.
        extra_vocab: Extra normal tokens (to build a model whose vocabulary differs).
        pad_vocab, pad_inside: Padding rows, see :func:`tiny_vocab`.
        chat_template: Whether to store a ChatML chat template, or the template to store (its jinja source).
        scale: Standard deviation of the output logits. The default gives next-token distributions
            whose top probability is mostly between 0.05 and 0.6 (median ~0.25): spread enough for
            sampling tests, peaked enough that greedy decoding is not arbitrary, and greedy
            decoding seldom emits an end-of-generation token at once.
        perturb: Relative standard deviation of noise added to every random tensor: with the target's
            ``seed`` and sizes this builds a draft that agrees with the target often but not always
            (0 = no noise, the default).
        perturb_seed: Seed of that noise.

    Returns:
        ``path`` as a :class:`Path`.
    """
    assert n_embd % n_head == 0 and n_head % n_head_kv == 0, (n_embd, n_head, n_head_kv)
    path = Path(path)
    tokens, types, merges = tiny_vocab(extra_vocab, pad_vocab, pad_inside)
    n_vocab = len(tokens)
    eos = tokens.index("<|endoftext|>")
    n_embd_kv = n_embd // n_head * n_head_kv
    rng = np.random.default_rng(seed)
    noise_rng = np.random.default_rng(perturb_seed)

    def normal(*shape: int, std: float) -> np.ndarray:
        x = rng.standard_normal(shape) * std
        if perturb:
            x = x + noise_rng.standard_normal(shape) * (std * perturb)
        return x.astype(np.float32)

    def linear(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        # [out, in] float32; the writer reverses the dims into ggml's [in, out] order.
        return normal(n_out, n_in, std=gain / np.sqrt(n_in))

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(f"tiny-qwen2-seed{seed}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    w.add_bos_token_id(eos)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template if isinstance(chat_template, str) else CHATML_TEMPLATE)

    w.add_tensor("token_embd.weight", normal(n_vocab, n_embd, std=1.0))
    for i in range(n_layer):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(n_embd, np.float32))
        # Larger q/k gain so that attention is peaked and the output depends on the context.
        w.add_tensor(f"{b}.attn_q.weight", linear(n_embd, n_embd, gain=2.0))
        w.add_tensor(f"{b}.attn_q.bias", normal(n_embd, std=0.1))
        w.add_tensor(f"{b}.attn_k.weight", linear(n_embd_kv, n_embd, gain=2.0))
        w.add_tensor(f"{b}.attn_k.bias", normal(n_embd_kv, std=0.1))
        w.add_tensor(f"{b}.attn_v.weight", linear(n_embd_kv, n_embd))
        w.add_tensor(f"{b}.attn_v.bias", normal(n_embd_kv, std=0.1))
        w.add_tensor(f"{b}.attn_output.weight", linear(n_embd, n_embd))
        w.add_tensor(f"{b}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"{b}.ffn_gate.weight", linear(n_ff, n_embd))
        w.add_tensor(f"{b}.ffn_up.weight", linear(n_ff, n_embd))
        w.add_tensor(f"{b}.ffn_down.weight", linear(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    # After the final RMS norm the hidden state has unit RMS, so logits have std ~= scale.
    w.add_tensor("output.weight", linear(n_vocab, n_embd, gain=scale))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_q4_k_m(folder: Path) -> dict[str, Path]:
    """A tiny qwen2 with the real target's head size (128) in ``folder``, and its Q4_K_M quantization
    (llama.cpp's quantizer): ``{"f32": path, "q4_k_m": path}``. ik_llama.cpp repacks the quantized one to
    ``Q4_K_R4``/``Q6_K_R4``, the kernels whose one-row shortcuts change a lone row's arithmetic."""
    import ctypes

    import llama_cpp

    f32 = write_tiny_qwen2_gguf(folder / "f32.gguf", n_embd=512, n_ff=1024, n_head=4, n_head_kv=2, n_layer=2)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    q4 = folder / "q4_k_m.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q4).encode(), ctypes.byref(params)) == 0
    return {"f32": f32, "q4_k_m": q4}
