"""fp8 hidden states: float8 e4m3 values with one fp32 scale per token and layer, ~H + 4 bytes per token and layer.

    q, scale = quantize(hidden)          # hidden (T, H) any float → q (T, H) float8_e4m3fn, scale (T,) fp32
    x = dequantize(q, scale)             # (T, H) bf16, ≈ hidden within half of fp8's step (2**-4, relative)

A store captured with `--dtype fp8` holds each layer's hidden states as float8_e4m3fn and its scales as fp32, one
per token (`hidden.{k}` and `hidden_scale.{k}`: hstap.store.names). The scale is the row's largest magnitude / 448
(e4m3's largest finite value), so each token uses the whole fp8 range whatever its size: hidden states of one
sequence span orders of magnitude (the first token's is often 100× the others'), which a per-tensor scale would
push into fp8's subnormals. A zero row gets scale 0 and stays exactly zero (no 0/0). Both functions run on
whatever device their input is on: the capture quantises on the GPU before the copy to the host, the trainer
dequantises on the GPU after the copy to it, so only fp8 bytes cross PCIe either way.

The hidden teacher (`teacher.hidden`) is not quantised: it is the training target, kept in bf16.
"""

from __future__ import annotations

import torch

from hstap.errors import HstapError
from hstap.store.names import hidden_name, scale_name

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPE = torch.float32


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (token) scaled float8 e4m3: x (..., H) → (q (..., H) float8_e4m3fn, scale (...) fp32).

    Rows that are all zero get scale 0 and q 0. Values are clamped to ±448 before the cast, so a rounding of
    x / scale just past 448 cannot become NaN on a torch whose cast does not saturate.
    """
    amax = x.abs().amax(dim=-1).float()  # (...,) exact: the max of x's own values
    # a tensor divisor, not the scalar: CUDA divides by a scalar as a multiply by its reciprocal (an ulp off the
    # CPU's quotient), and a store must not depend on the device that wrote it
    scale = amax / torch.full_like(amax, FP8_MAX)  # (...,)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero rows: 0 / 1 = 0, not 0 / 0
    q = (x.float() / safe[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # (..., H)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q (..., H) float8_e4m3fn, scale (...) → (..., H) in `dtype` (bf16: what the trainer computes in)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def dequantize_sample(sample: dict) -> dict:
    """A sample with fp8 `hidden` and its `hidden_scale` per layer → the same sample with bf16 `hidden` (in place);
    samples without scales pass through unchanged."""
    scales = sample.pop("hidden_scale", None)
    if scales is None:
        return sample
    for k, t in sample["hidden"].items():
        if k not in scales:
            raise HstapError(f"sample {sample.get('id')!r}: {hidden_name(k)} is fp8 but has no {scale_name(k)}")
        sample["hidden"][k] = dequantize(t, scales[k])
    return sample


def dequantize_aux(aux: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A collated batch: aux (B, S, n*H) float8_e4m3fn, scales (B, S, n) → (B, S, n*H) in `dtype`, on aux's
    device (the trainer calls it after the copy to the GPU, so the host moves 1 byte per value)."""
    b, s, width = aux.shape
    n = scales.shape[-1]
    return dequantize(aux.view(b, s, n, width // n), scales).view(b, s, width)  # (B, S, n, H) → (B, S, n*H)
