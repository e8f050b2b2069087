"""QuantLinear: a linear layer stored as compressed-tensors tensors, computed through `dispatch.linear`.

Until a kernel is attached (`dispatch.prepare_layer`) it holds the checkpoint's tensors and runs the torch
reference. Attaching a kernel hands it the layer once to repack into the kernel's own layout (`prepared`), after
which the checkpoint tensors are released, so a layer never holds two copies of its weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.runtime import dispatch
from quantkit.runtime.formats import INPUT_TENSORS, WEIGHT_TENSORS, LinearFormat


def dense_parameter(t: torch.Tensor) -> nn.Parameter:
    """A runtime model's dense (unquantised) tensor as a Parameter.

    Floating tensors require grad, as in transformers' from_pretrained, for speed, not training: ATen's matmul
    folds a 3-D input into one mm at once when the weight requires grad, and otherwise only when the input's
    strides allow a view. The last-position slice of a prefill (`logits_to_keep=1`) does not, so matmul falls
    back to bmm, which copies the whole weight on every call (SmolLM2-sized lm_heads: ~0.7 s instead of ~12 ms).
    The runtime computes under inference_mode, where nothing is recorded for autograd either way."""
    return nn.Parameter(t, requires_grad=t.is_floating_point())


class DenseLinear(nn.Linear):
    """The runtime's dense (unquantised) linear. One row of bf16/fp16 on CPU goes to ATen's own GEMV instead of
    oneDNN, whose one-row bf16 matmul streams the weight at a fraction of the memory bandwidth on AVX512-BF16 /
    AMX CPUs (benchmarks/results/int4_kernels.md, the 49152 x 2048 head); from two rows on oneDNN is the faster.
    Decode at batch 1 and a prefill's last-position head call are such rows. oneDNN's switch is process state:
    it is turned off for this one call and restored, whatever happens inside."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and x.numel() == x.shape[-1]
                and torch.backends.mkldnn.enabled):
            torch.backends.mkldnn.enabled = False
            try:
                return F.linear(x, self.weight, self.bias)
            finally:
                torch.backends.mkldnn.enabled = True
        return F.linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    def __init__(self, fmt: LinearFormat, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.fmt = fmt
        self.kind = fmt.kind
        self.in_features, self.out_features = in_features, out_features
        for name in (*WEIGHT_TENSORS, *INPUT_TENSORS):
            self.register_buffer(name, tensors.get(name))
        self.bias = None if bias is None else dense_parameter(bias)
        # The dtype activations arrive in (kernels pick their layout for it); default: the scales' dtype.
        scale_dtype = tensors["weight_scale"].dtype
        if compute_dtype is None and not (scale_dtype.is_floating_point and scale_dtype.itemsize >= 2):
            compute_dtype = torch.bfloat16  # fp4's e4m3 / e8m0 scales say nothing of the model's dtype
        self.compute_dtype = compute_dtype or scale_dtype
        self.kernel = None  # None: the torch reference on the checkpoint tensors
        self.prepared = None

    def attach(self, kernel, prepared) -> None:
        """Serve this layer with `kernel` from now on; the checkpoint tensors are no longer needed."""
        self.kernel, self.prepared = kernel, prepared
        for name in (*WEIGHT_TENSORS, *INPUT_TENSORS):
            self._buffers[name] = None

    @property
    def kernel_name(self) -> str:
        return "reference" if self.kernel is None else self.kernel.name

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer keeps: its buffers, bias and the kernel's prepared tensors."""
        own = [t for t in (*self._buffers.values(), *self._parameters.values()) if t is not None]
        return own + ([] if self.prepared is None else self.prepared.tensors())

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.prepared is not None:
            self.prepared.apply(fn)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(x, self)

    def extra_repr(self) -> str:
        w = self.fmt.weights
        detail = f"{w.strategy}" + (f" g{w.group_size}" if w.strategy == "group" else "")
        return (f"in={self.in_features}, out={self.out_features}, {self.fmt.format} {self.kind} {detail}, "
                f"kernel={self.kernel_name}")
