"""Tiny random-weight transformers Qwen2 models and a byte-level BPE tokenizer, built in memory.

The vocabulary is the one of :mod:`tiny_gguf` (256 GPT-2 byte symbols, a few merges, the ChatML control
tokens), so the llama.cpp and Hugging Face tiny models tokenize alike. Weights follow tiny_gguf's scales
(unit-variance embeddings, fan-in-scaled linears, output logits with std ~2.5) so that next-token
distributions are neither flat nor one-hot. ``n_padding`` adds padding rows to the LM head past the
tokenizer's ids, as real checkpoints do (Qwen: 151,665 tokens, 151,936 or 152,064 rows); with
``padding_bait`` those rows copy scaled-up real rows, so an engine that does not mask them would emit
padded ids often.

This module knows nothing about specdec; it only builds models.
"""

from __future__ import annotations

import torch
from tiny_gguf import CHATML_TEMPLATE, CONTROL_TOKENS, tiny_vocab


def tiny_tokenizer(extra_vocab: int = 0):
    """A ``PreTrainedTokenizerFast`` over tiny_gguf's vocabulary (``extra_vocab`` extra normal tokens
    before the control tokens): byte-level BPE, ChatML template, ``<|im_end|>`` as eos, control tokens
    special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, _, merges = tiny_vocab(extra_vocab)
    normal = tokens[: len(tokens) - len(CONTROL_TOKENS)]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(normal)}, merges=[tuple(m.split(" ")) for m in merges])
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    assert tok.convert_tokens_to_ids(list(CONTROL_TOKENS)) == list(range(len(normal), len(tokens)))
    return tok


def tiny_qwen2(seed: int = 0, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
               n_ff: int = 128, n_ctx: int = 512, n_padding: int = 0, padding_bait: bool = False,
               scale: float = 2.5, extra_vocab: int = 0):
    """A random-weight ``Qwen2ForCausalLM`` in float32, eval mode, on the CPU.

    Args:
        seed: Seed of the weights.
        n_layer, n_embd, n_head, n_head_kv, n_ff: Shape (grouped-query attention when
            ``n_head_kv < n_head``).
        n_ctx: ``max_position_embeddings``.
        n_padding: LM-head rows past the tokenizer's vocabulary.
        padding_bait: Make each padding row 3x a real row, so padded ids often have the top logit.
        scale: Standard deviation of the output logits.
        extra_vocab: As for :func:`tiny_tokenizer` (the vocabulary the model is built for).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokens, _, _ = tiny_vocab(extra_vocab)
    n_real = len(tokens)
    config = Qwen2Config(
        vocab_size=n_real + n_padding, hidden_size=n_embd, intermediate_size=n_ff, num_hidden_layers=n_layer,
        num_attention_heads=n_head, num_key_value_heads=n_head_kv, max_position_embeddings=n_ctx,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        bos_token_id=n_real - 3, eos_token_id=[n_real - 1, n_real - 3], pad_token_id=n_real - 3,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)

    def normal_(p: torch.Tensor, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=gen) * std)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                normal_(p, 0.1)
            elif "embed_tokens" in name:
                normal_(p, 1.0)
            else:
                # Larger q/k gain so that attention is peaked and the output depends on the context.
                gain = 2.0 if ("q_proj" in name or "k_proj" in name) else scale if name == "lm_head.weight" else 1.0
                normal_(p, gain / p.shape[1] ** 0.5)
        if padding_bait and n_padding:
            rows = torch.randint(0, n_real - 3, (n_padding,), generator=gen)
            model.lm_head.weight[n_real:] = 3.0 * model.lm_head.weight[rows]
    model.generation_config.eos_token_id = [n_real - 1, n_real - 3]
    return model.eval()


def layer_skip_draft(model, n_layer: int = 1, noise: float = 0.0, seed: int = 0):
    """A draft made from ``model``: its first ``n_layer`` blocks, embeddings, final norm and LM head
    (self-speculation by layer skipping), optionally with Gaussian noise of relative size ``noise`` on
    every weight. It agrees with the target often but not always, as a real draft does."""
    import copy

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n_layer
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layer]
    draft = type(model)(config)
    keep = {k: v for k, v in model.state_dict().items()
            if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n_layer)}
    gen = torch.Generator().manual_seed(seed)
    if noise:
        keep = {k: v + noise * v.std() * torch.randn(v.shape, generator=gen) if v.ndim == 2 else v
                for k, v in keep.items()}
    draft.load_state_dict(keep)
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()
