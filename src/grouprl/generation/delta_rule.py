"""One decode step of a gated delta-rule layer (Qwen3.5's linear attention, `Qwen3_5GatedDeltaNet`), over state
buffers updated in place, so that a captured step can replay it (static_kv_cache.StaticStateLayer holds them).

A token's layer, as transformers computes it (its recurrent reference, the chunked training forward's algebra):
- a short causal convolution over the last `kernel` inputs of q, k and v stacked (the conv state), then SiLU;
- q and k L2-normed per head, q scaled by head_dim^-0.5; key heads repeated for the value heads they serve;
- the state S (rows, value heads, key dim, value dim) decays by exp(g), then takes the delta rule's correction
  k (beta (v - S^T k))^T; the output is S^T q;
- the output normed per head (its weight w, not 1 + w) and gated by SiLU(z).

Everything after the convolution runs in fp32, as transformers' does; the convolution multiplies its inputs and its
weight in their dtype (the products', `DeltaNet.conv_weight`), accumulates in fp32 and rounds to that dtype, as a
bf16 conv1d under autocast does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # transformers' l2norm inside the delta rule


class DeltaNet(NamedTuple):
    """A gated delta-rule layer's constants for decode steps (fused_decode gathers them once a call)."""

    conv_weight: torch.Tensor  # (q + k + v channels, kernel), fp32 holding the products' dtype's values
    conv_bias: torch.Tensor | None  # as the weight
    decay_rate: torch.Tensor  # (value heads,) fp32: -exp(A_log)
    dt_bias: torch.Tensor  # (value heads,)
    norm_weight: torch.Tensor  # (value dim,)
    norm_eps: float
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int


def conv_step(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Push `x` (rows, channels) into `state` (rows, channels, kernel; fp32, holding `x`'s dtype's values), oldest
    input first, in place; return SiLU of the depthwise causal convolution at the new input, rounded to `x`'s dtype
    before it, as a conv1d in that dtype rounds its output."""
    state.copy_(torch.cat([state[..., 1:], x[..., None]], dim=-1))  # the cat promotes x to fp32 (exact)
    out = torch.einsum("rck,ck->rc", state, weight)
    if bias is not None:
        out = out + bias
    return F.silu(out.to(x.dtype))


def delta_rule_step(
    state: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """One token of the gated delta rule, in fp32. state (rows, value heads, key dim, value dim), updated in place;
    query, key (rows, value heads, key dim) already normed and scaled; value (rows, value heads, value dim); g, beta
    (rows, value heads). Returns S^T q (rows, value heads, value dim)."""
    state.mul_(g.exp()[..., None, None])
    remembered = torch.matmul(key[:, :, None, :], state)[:, :, 0]  # S^T k
    correction = (value - remembered) * beta[..., None]
    state.add_(key[..., :, None] * correction[..., None, :])
    return torch.matmul(query[:, :, None, :], state)[:, :, 0]


def l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def delta_net_step(
    layer: DeltaNet,
    mixed: torch.Tensor,
    gate_z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
) -> torch.Tensor:
    """The layer's output before its out projection, (rows, value heads x value dim) in `mixed`'s dtype, from its
    input projections' outputs at one token: `mixed` (q, k, v stacked), `gate_z`, `b` and `a`. Updates the states."""
    rows, dtype = mixed.shape[0], mixed.dtype
    mixed = conv_step(conv_state, mixed, layer.conv_weight, layer.conv_bias).float()
    key_width = 2 * layer.key_heads * layer.key_dim  # q's and k's
    query_key, value = mixed.split([key_width, layer.value_heads * layer.value_dim], dim=-1)
    query_key = l2_normed(query_key.view(rows, 2, layer.key_heads, layer.key_dim))  # q and k normed in one pass
    served = layer.value_heads // layer.key_heads  # value heads a key head serves, consecutive
    if served > 1:
        query_key = query_key.repeat_interleave(served, dim=2)
    query, key = query_key.unbind(1)
    query = query * layer.key_dim**-0.5
    g = layer.decay_rate * F.softplus(a.float() + layer.dt_bias)
    out = delta_rule_step(
        recurrent_state, query, key, value.view(rows, layer.value_heads, layer.value_dim), g, b.sigmoid().float()
    )
    # rounded to the layer's dtype, as transformers' rule returns it; its gated norm: normed in fp32, rounded again,
    # times w, times SiLU(z) in fp32
    normed = F.rms_norm(out.to(dtype).float(), (layer.value_dim,), None, layer.norm_eps).to(dtype)
    z = gate_z.view(rows, layer.value_heads, layer.value_dim).float()
    return (layer.norm_weight * normed * F.silu(z)).to(dtype).view(rows, -1)
