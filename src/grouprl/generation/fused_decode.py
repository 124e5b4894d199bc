"""A decode step of a Llama-family model computed from its weights instead of through its forward.

A decode step pushes one token per running sequence through every layer. Its products are small
(a few dozen rows), so on a CPU the step's cost beyond them is the operators around them: a
transformers forward runs each of SmolLM2-135M's 30 layers as ~40 modules and operators (three
q/k/v products, two gate/up products, RoPE with its own cos/sin per layer, mask handling, output
objects), and under bf16 autocast it casts every input on the way in. `FusedDecoder` does the
same arithmetic with fewer, larger operators:

- under bf16 autocast it casts each layer's weights once per generate call, q/k/v stacked into one
  matrix and gate/up into another (one product each instead of three and two); weights already in
  the products' dtype (fp32 without autocast) are used as they are, with no copy; bf16 weights on the
  CPU are then packed once into oneDNN's layout (decode_products.pack_weight), which `F.linear` would
  redo at every product;
- per step: RMSNorm (`F.rms_norm`) -> q/k/v product -> RoPE on q and k together, cos/sin once per
  step -> the shared-prefix cache's attention -> o product -> RMSNorm -> gate/up product ->
  SiLU(gate) * up -> down product, the residual stream in the weights' dtype as in the model.

Measured (bench/bench_fused_decode.py, generation alone, 2-core AVX512-BF16 CPU, alternating): under
bf16 autocast 1.18-1.50x the tokens/s of decoding through the forward on W1-W5 (SmolLM2-135M: 1.22x),
in fp32 0.99-1.09x: there a 32-row step is bound by streaming the fp32 weights from memory.

Which models: the structure is checked by name and type here (Llama, Mistral, Qwen2 and Qwen3
layers; LoRA adapters from peft are merged into the weights for the call), and, once per model, a
probe compares the logits with the model's own forward (fused_decode_probe.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from grouprl.generation.decode_products import few_row_linear, pack_weight, packed_linear, packs_weights
from grouprl.generation.shared_prefix import SharedPrefixCache
from grouprl.model.loading import runs_head_in_fp32

Product = list[tuple[torch.Tensor, torch.Tensor | None]]  # (weight, bias) pairs whose outputs are concatenated


class _Layer(NamedTuple):
    input_norm: torch.Tensor
    input_eps: float
    qkv: Product
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm of each head's q and k before RoPE
    k_norm: torch.Tensor | None
    head_eps: float | None
    o: Product
    post_norm: torch.Tensor
    post_eps: float
    gate_up: Product
    down: Product


def _norm_eps(norm: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        if isinstance(getattr(norm, name, None), float):
            return getattr(norm, name)
    return None


def _is_silu(act: object) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _linear_weight(proj: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias `proj` applies: a plain nn.Linear's, or a peft LoRA layer's base plus its active,
    unmerged adapters (in eval mode, where LoRA dropout is off)."""
    if type(proj) is torch.nn.Linear:
        return proj.weight.detach(), (None if proj.bias is None else proj.bias.detach())
    base = getattr(proj, "base_layer", None)
    weight, bias = _linear_weight(base)
    if getattr(proj, "merged", False) or getattr(proj, "disable_adapters", False):  # merged, or switched off
        return weight, bias
    for adapter in proj.active_adapters:
        if adapter in proj.lora_A:
            weight = weight + proj.get_delta_weight(adapter).detach().to(weight.dtype)
    return weight, bias


def structure_reason(model: torch.nn.Module, check_dtype: bool = True) -> str | None:
    """None if `model` looks like a Llama-family decoder FusedDecoder can run, else what differs. `check_dtype`:
    require fp32 weights, the ones its probe can check (fused_decode_probe.py)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    config = getattr(model, "config", None)
    if layers is None or config is None or getattr(inner, "rotary_emb", None) is None:
        return "not a Llama-family causal LM (no model.layers / model.rotary_emb)"
    layer_types = getattr(config, "layer_types", None)
    if getattr(config, "sliding_window", None) is not None and (
        layer_types is None or "sliding_attention" in layer_types
    ):
        return "it has sliding-window layers"
    for what in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, what, None) is not None:
            return f"config.{what} is set"
    if type(model.get_input_embeddings()) is not torch.nn.Embedding or getattr(inner, "norm", None) is None:
        return "its embedding or final norm is not a plain one"
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return "its LM head is not an nn.Linear"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        for proj in projections:
            reason = _projection_reason(proj)
            if reason:
                return reason
        if any(getattr(getattr(mlp, n), "bias", None) is not None for n in ("gate_proj", "up_proj", "down_proj")):
            return "its MLP has biases"
        if not _is_silu(getattr(mlp, "act_fn", None)):
            return "its MLP activation is not SiLU"
        norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        norms += [n for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if n is not None]
        if any(n is None or _norm_eps(n) is None for n in norms):
            return "its layer norms are not RMSNorms with an eps"
    weights = model.get_input_embeddings().weight
    if check_dtype and weights.dtype != torch.float32:
        return f"its weights are {weights.dtype} (the probe checks fp32 weights only)"
    return None


def _projection_reason(proj: torch.nn.Module | None) -> str | None:
    if proj is None:
        return "its layers lack q/k/v/o or gate/up/down projections"
    if type(proj) is torch.nn.Linear:
        return None
    base = getattr(proj, "base_layer", None)
    if base is not None and hasattr(proj, "get_delta_weight") and hasattr(proj, "lora_A"):
        if any(proj.use_dora.get(a, False) for a in proj.active_adapters):
            return "a DoRA adapter is active"
        return _projection_reason(base)
    return f"a projection is a {type(proj).__name__}, not an nn.Linear or a LoRA layer on one"


class FusedDecoder:
    """`step(tokens, positions, cache) -> logits`: one decode step with `model`'s current weights (module doc).

    Build it once per generate call, after the prefill: it copies the weights as they are then.
    """

    def __init__(self, model: torch.nn.Module):
        inner, config = model.model, model.config
        device = model.get_input_embeddings().weight.device
        self.device_type = device.type
        autocast = torch.is_autocast_enabled(device.type)
        self.residual_dtype = model.get_input_embeddings().weight.dtype
        self.dtype = torch.get_autocast_dtype(device.type) if autocast else self.residual_dtype
        self.packed = packs_weights(self.dtype, device)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = self.head_dim**-0.5
        self.rotary = inner.rotary_emb
        self.embedding = model.get_input_embeddings().weight.detach()
        self.layers = [self._gather(layer) for layer in inner.layers]
        self.final_norm, self.final_eps = inner.norm.weight.detach(), _norm_eps(inner.norm)
        head = model.get_output_embeddings()
        head_dtype = torch.float32 if runs_head_in_fp32(head) else self.dtype
        weight, bias = _linear_weight(head)
        self.head = self._packed([(weight.to(head_dtype), None if bias is None else bias.to(head_dtype))])

    def _gather(self, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v, o = (_linear_weight(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        gate, up, down = (_linear_weight(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return _Layer(
            input_norm=layer.input_layernorm.weight.detach(),
            input_eps=_norm_eps(layer.input_layernorm),
            qkv=self._product([q, k, v]),
            q_norm=None if q_norm is None else q_norm.weight.detach(),
            k_norm=None if k_norm is None else k_norm.weight.detach(),
            head_eps=None if q_norm is None else _norm_eps(q_norm),
            o=self._product([o]),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            post_eps=_norm_eps(layer.post_attention_layernorm),
            gate_up=self._product([gate, up]),
            down=self._product([down]),
        )

    def _product(self, pairs: Product) -> Product:
        """The weights in the products' dtype. Where that takes a cast (a copy anyway) they are stacked into one
        product; weights already in it are used as they are, with no copy (in fp32 stacking gained nothing:
        58 vs 61 ms a W5 step)."""
        if all(weight.dtype == self.dtype for weight, _ in pairs) or len(pairs) == 1:
            return self._packed([(w.to(self.dtype), None if b is None else b.to(self.dtype)) for w, b in pairs])
        bias = None if pairs[0][1] is None else torch.cat([b for _, b in pairs]).to(self.dtype)
        return self._packed([(torch.cat([w for w, _ in pairs]).to(self.dtype), bias)])

    def _packed(self, product: Product) -> Product:
        """bf16 weights reordered once for oneDNN (decode_products.pack_weight); others as they are."""
        if not self.packed:
            return product
        return [(pack_weight(w), b) if w.dtype == torch.bfloat16 else (w, b) for w, b in product]

    def _apply(self, x: torch.Tensor, product: Product) -> torch.Tensor:
        x = x.to(product[0][0].dtype)
        outs = [
            packed_linear(x, weight, bias) if weight.is_mkldnn else few_row_linear(x, weight, bias)
            for weight, bias in product
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: SharedPrefixCache) -> torch.Tensor:
        """tokens, positions: (R,) -> fp32 logits (R, vocab); writes the step's keys and values into `cache`."""
        with torch.autocast(self.device_type, enabled=False):  # the products' dtype is set by the weights
            return self._step(tokens, positions, cache)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: SharedPrefixCache) -> torch.Tensor:
        rows, heads, kv_heads, dim = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        hidden = F.embedding(tokens, self.embedding)  # (R, H), the residual stream
        cos, sin = self.rotary(hidden[:, None], positions[:, None])  # (R, 1, D) each
        half = dim // 2
        cos = cos.float()  # (R, 1, D): broadcasts over the heads
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2): one cat of x, the sign folded into sin
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).float()
        q_width, k_width = heads * dim, kv_heads * dim
        width = hidden.shape[-1]
        for index, layer in enumerate(self.layers):
            x = F.rms_norm(hidden, (width,), layer.input_norm, layer.input_eps)
            qkv = self._apply(x, layer.qkv)
            qk = qkv[:, : q_width + k_width].float().view(rows, heads + kv_heads, dim)
            if layer.q_norm is not None:
                qk = torch.cat(
                    [
                        F.rms_norm(qk[:, :heads], (dim,), layer.q_norm.float(), layer.head_eps),
                        F.rms_norm(qk[:, heads:], (dim,), layer.k_norm.float(), layer.head_eps),
                    ],
                    dim=1,
                )
            qk = qk * cos + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * signed_sin
            value = qkv[:, q_width + k_width :].view(rows, kv_heads, 1, dim)
            cache.update(qk[:, heads:, None], value, index)
            attended = cache.attend(index, qk[:, :heads, None], self.scaling)  # (R, 1, heads, D)
            out = self._apply(attended.reshape(rows, q_width), layer.o)
            hidden = hidden + out.to(self.residual_dtype)
            x = F.rms_norm(hidden, (width,), layer.post_norm, layer.post_eps)
            gate_up = self._apply(x, layer.gate_up)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = hidden + self._apply(F.silu(gate) * up, layer.down).to(self.residual_dtype)
        hidden = F.rms_norm(hidden, (width,), self.final_norm, self.final_eps)
        return self._apply(hidden, self.head).float()
