"""oneDNN-prepacked linear layers: cheaper float32 forward passes on CPU, most of all for a few rows.

Why it matters for speculation: the cost of scoring ``k+1`` tokens against one decides whether a draft
pays (see :mod:`specdec.policy.cost`). With PyTorch's default CPU path (MKL ``sgemm``/``sgemv`` on dense
weights), a forward pass of a few rows is far from memory-bound: a few rows cost far more than one. With
every ``nn.Linear`` swapped for a oneDNN inner product on weights converted once to oneDNN's layout (what
``torch.utils.mkldnn.to_mkldnn`` does, and Intel Extension for PyTorch's weight prepacking), plain decoding
gets faster and scoring a few rows costs little more than one (measured: ``docs/bench/hf/README.md``, "Why
specdec prepacks the linear layers").

``torch.utils.mkldnn.MkldnnLinear`` does the same but is a TorchScript module (``torch.jit`` is deprecated:
torch 2.13 warns once per layer), hence the few lines here. Outputs agree with ``nn.Linear`` to float32
rounding (different summation order), not bit for bit.
"""

from __future__ import annotations

import torch


def prepack_available() -> bool:
    """Whether this torch build has the oneDNN inner product (``torch._C._nn.mkldnn_linear``)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch._C._nn, "mkldnn_linear")


class PrepackedLinear(torch.nn.Module):
    """``nn.Linear`` for inference, its float32 weight held in oneDNN's layout.

    Input ``[..., in_features] float32`` (any strides), output ``[..., out_features] float32`` dense.
    ``weight`` keeps the attribute name (``[out_features, in_features]``, a oneDNN tensor), so code that
    reads ``module.weight.shape`` keeps working. The dense weight is copied, not shared: a weight tied to
    an embedding (``tie_word_embeddings``) is held twice. No autograd: inference only.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("weight", linear.weight.detach().to_mkldnn(), persistent=False)
            bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()
            self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_linear(x.to_mkldnn(), self.weight, self.bias).to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: torch.nn.Module) -> int:
    """Swap, in place, every float32 CPU ``nn.Linear`` of ``model`` for a :class:`PrepackedLinear`.

    Returns:
        How many layers were swapped (0 when oneDNN is unavailable, or on other dtypes and devices, which
        are left as they are: bfloat16/float16 CPU inner products are slow without AMX/AVX512-BF16).
    """
    if not prepack_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is torch.nn.Linear and child.weight.dtype == torch.float32
                    and child.weight.device.type == "cpu"):
                setattr(parent, name, PrepackedLinear(child))
                swapped += 1
    return swapped
