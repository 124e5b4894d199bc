"""Decode steps on few rows: a Llama-family model's step computed from its weights instead of through its
forward (`FusedDecoder`), whether a model may use it (`fuses`), and the few-row CPU products decode steps
run on (`weight_major_decode` for steps through the model's forward, packed bf16 weights for the fused step).

A decode step pushes one token per running sequence through every layer. Its products are small
(a few dozen rows), so on a CPU the step's cost beyond them is the operators around them: a
transformers forward runs each of SmolLM2-135M's 30 layers as ~40 modules and operators (three
q/k/v products, two gate/up products, RoPE with its own cos/sin per layer, mask handling, output
objects), and under bf16 autocast it casts every input on the way in. `FusedDecoder` does the
same arithmetic with fewer, larger operators:

- under bf16 autocast it casts each layer's weights once per generate call, q/k/v stacked into one
  matrix and gate/up into another (one product each instead of three and two); weights already in
  the products' dtype (fp32 without autocast) are used as they are, with no copy; bf16 weights on the
  CPU are then packed once into oneDNN's layout (`pack_weight`), which `F.linear` would
  redo at every product;
- per step: RMSNorm (`F.rms_norm`) -> q/k/v product -> RoPE on q and k together, cos/sin once per
  step -> the shared-prefix cache's attention -> o product -> RMSNorm -> gate/up product ->
  SiLU(gate) * up -> down product, the residual stream in the weights' dtype as in the model.

Measured (bench/bench_fused_decode.py, generation alone, 2-core AVX512-BF16 CPU, alternating): under
bf16 autocast 1.18-1.50x the tokens/s of decoding through the forward on W1-W5 (SmolLM2-135M: 1.22x),
in fp32 0.99-1.09x: there a 32-row step is bound by streaming the fp32 weights from memory.

Which models: the structure is checked by name and type (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Phi-3 and
Gemma 3 layers; LoRA adapters from peft are merged into the weights for the call), and, once per model, a probe
compares the logits with the model's own forward; the verdict is logged once (`fuses`). What differs between
these families is a parameter of the step:
- SmolLM3's NoPE layers leave q and k unrotated;
- Phi-3's stacked q/k/v and gate/up projections are one product each, as they are, and its RoPE turns the first
  `partial_rotary_factor` of each head;
- Gemma 3 scales its embeddings by sqrt(hidden), norms by (1 + w) in fp32 (four norms a layer: its attention's and
  its MLP's outputs are normed too), uses tanh-approximated GELU and a score scale of its own, and gives its
  sliding-window layers a RoPE table of their own;
- a layer of routed experts (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, OLMoE, GPT-OSS) runs the model's own block,
  its router and top-k and transformers' experts implementation, the experts' weights in the products' dtype
  (`FusedDecoder._routed`);
- a vision-language model's language model (Gemma 3 4B and up, LLaVA) runs its text-only prompts (`text_decoder`);
- GPT-OSS's attention sinks join each head's softmax (over the static cache only), and its RoPE, given once for
  both halves, is repeated for the rotate_half layout (`rope_halves`);
- OLMo 2 / 3 norm their attention's and MLP's outputs only, and q and k over the whole projection (OLMoE too);
  GLM-4 norms both, inputs and outputs;
- GLM, GLM-4 and ERNIE 4.5 turn neighbouring pairs of dimensions in RoPE, not halves (`rope_interleaved`);
- Granite multiplies its embeddings and its layers' outputs and divides its logits by constants of its config;
- Qwen3.5's linear-attention layers run a gated delta rule over the static cache's state buffers (delta_rule.py),
  its attention multiplies its output by a gate from its q projection, and its norms are Gemma's (1 + w);
- Ministral 3's and longrope's steps hold within `position_limit` only.
Sliding windows (Gemma 3, Mistral) run over the static decode loop's cache only (static_kv_cache.py); shared-prefix
decoding serves none.

The structure check (`structure_reason`) finds what the fused step cannot run by name and
type; the probe finds what it would compute differently (Gemma has Llama's module names but scales
its embeddings and norms): it decodes two left-padded prompts, 2 samples each, for 3 steps, through
the model's forward and through FusedDecoder over the same shared-prefix cache, in fp32, and
compares the logits (tolerance: shared_prefix.logit_tolerance with no noise, i.e. 1e-3 of the
logits' scale). Both run the model's class forward: `accelerator.prepare` replaces a bf16 model's
forward on the instance with one under autocast, which would make the fp32 reference a bf16 one. Only
fp32 weights take the fused path (bf16 autocast on them included): in lower-precision weights the
comparison cannot tell a different rounding order from a different computation. An error other than
"this model cannot run it" propagates.

Decode-step linear layers on the CPU, computed in the weight-major orientation (`few_row_linear`).

A decode step multiplies a handful of rows (one token per sequence still running) by every weight
matrix. `F.linear` computes that as x @ W^T; the same product computed as (W @ x^T)^T, the weight as
the left-hand operand, runs faster in the CPU BLAS that PyTorch uses here, provided the number of
rows suits its kernels: from 9 rows on, rows are padded with zeros to a multiple of 16 (31 rows, a
W1/W2 step after one sequence finished, are much slower than 32). Median of 11 runs, 8 distinct
weights per shape, fp32, this project's 2-core AVX2 machine, summed over W1's five weight shapes
and 12 row counts from 2 to 31: x @ W^T 274 ms, W @ x^T unpadded 277 ms (better at 2-8 rows, worse at 15, 30, 31),
W @ x^T with the padding 228 ms. A whole decode step of W4's model: 1.6x faster at 2-4 rows;
W3's, with its 151,936-row head, 1.9x at 8 rows.

bf16 products go through oneDNN, which `F.linear` asks to reorder the weight into its blocked
layout at every call. `pack_weight` does that once and `packed_linear` multiplies with the packed
weight (the results are those of `F.linear`); the fused decode step packs its weights once per
generate call, where oneDNN runs bf16 on this CPU (`packed_bf16_runs`; not on an AVX2-only one).
SmolLM2-135M's 30 layers and head, one decode step, median of 30, 2-core AVX512-BF16 CPU: 37.0 -> 28.4 ms
at 32 rows, 25.1 -> 15.9 at 16, 19.8 -> 11.3 at 8.

Results differ from `F.linear` by summation order only (about 1e-6 in the logits). Only float32
inputs on the CPU without autograd take it, with 2-32 rows: GPUs' BLAS and bf16 kernels have their
own shape heuristics and were not measured, 1 row is a matrix-vector product either way, and from
about 128 rows x @ W^T is faster. Training passes keep `F.linear`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.utils import logging

from grouprl.core.cpu_capabilities import isa_limits, onednn_runs_bf16
from grouprl.generation.delta_rule import DeltaNet, delta_net_step
from grouprl.generation.shared_prefix import (
    SAMPLES,
    SharedPrefixCache,
    SharedPrefixLayer,
    logit_tolerance,
    shared_decode,
    shared_prefill,
)
from grouprl.generation.static_kv_cache import StaticKVCache
from grouprl.model.forward import cache_keyword, describe, is_unsupported
from grouprl.model.layer_configs import is_heterogeneous
from grouprl.model.loading import runs_head_in_fp32
from grouprl.model.logprobs import position_ids_from_mask

if TYPE_CHECKING:
    from grouprl.generation.static_kv_cache import StaticLayerCache, StaticStateLayer

logger = logging.get_logger("grouprl")

Product = list[tuple[torch.Tensor, torch.Tensor | None]]  # (weight, bias) pairs whose outputs are concatenated

_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()

FEW_ROWS = range(2, 33)
UNPADDED_ROWS = 8  # above this, rows are padded to a multiple of 16


class _Experts(NamedTuple):
    block: torch.nn.Module  # the model's mixture-of-experts block: router, top-k and experts
    weights: dict[
        str, torch.Tensor
    ]  # the experts' weights the step substitutes, by name in `block` (none: as they are)
    wrappers: list[torch.nn.Module]  # peft's LoRA wrappers of the experts' parameters, passed by while substituted


class _Layer(NamedTuple):
    input_norm: torch.Tensor | None  # None: OLMo 2 / 3, which norm the attention's and the MLP's outputs only
    input_eps: float | None
    qkv: Product  # a gated attention's gate after v; a delta-rule layer's input projections (q/k/v, z, b, a)
    gated: bool  # Qwen3.5's attention: its output times sigmoid(gate), a second half of each head's q projection
    delta: DeltaNet | None  # a linear-attention layer (Qwen3.5's gated delta rule) in place of attention
    q_norm: torch.Tensor | None  # Qwen3, Gemma 3: RMSNorm of each head's q and k before RoPE
    k_norm: torch.Tensor | None
    head_eps: float | None
    norm_after_rope: bool  # HunYuan: q and k normed after RoPE
    rope: str | None  # the RoPE table its q and k take (Gemma 3: one a layer type); None: a NoPE layer (SmolLM3)
    window: int | None  # a sliding-window layer's window (the static cache's biases; shared prefixes serve none)
    sinks: torch.Tensor | None  # GPT-OSS: a logit per head that takes softmax mass and adds nothing (static cache)
    o: Product
    attention_out_norm: tuple[torch.Tensor, float] | None  # Gemma: the attention's output normed before the add ...
    post_norm: torch.Tensor | None  # the MLP input's norm (None: OLMo 2 / 3)
    post_eps: float | None
    gate_up: Product  # empty in a layer of routed experts
    down: Product
    experts: _Experts | None  # a layer of routed experts (Qwen3-MoE, GPT-OSS): run as the model's own block
    mlp_out_norm: tuple[torch.Tensor, float] | None  # ... and so is its MLP's


FULL = "full_attention"  # a layer type without a window
ONE_ROPE = "every layer"  # the RoPE table key of a model whose layers share one
SCALED_EMBEDDINGS = ("Gemma3TextScaledWordEmbedding",)  # an nn.Embedding times its `embed_scale`
# x normed in fp32 times (1 + w), rounded to x's dtype once (Qwen3.5's norms compute as Gemma's)
GEMMA_NORMS = ("GemmaRMSNorm", "Gemma3RMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")
LINEAR_ATTENTION = "linear_attention"  # a layer type whose mixer is a gated delta rule (Qwen3.5), not attention
DELTA_NET_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # Qwen3.5's projections
# norms of a layer's attention or MLP output (Gemma, OLMo 2 / 3: post_attention_layernorm too; `_output_norms`)
OUTPUT_NORM_NAMES = (
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_self_attn_layernorm",
    "post_mlp_layernorm",
)
TANH_GELUS = ("GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh")  # gelu_pytorch_tanh's classes across versions


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
    require fp32 weights, the ones its probe can check (`probe`)."""
    inner, config = text_decoder(model)
    layers = getattr(inner, "layers", None)
    if layers is None or config is None or getattr(inner, "rotary_emb", None) is None:
        return "not a Llama-family causal LM (no model.layers / model.rotary_emb)"
    if is_heterogeneous(config):
        return f"its layers differ in {sorted(config.per_layer_attributes)} (config.per_layer_config)"
    for what in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, what, None) is not None:
            return f"config.{what} is set"
    embedding = model.get_input_embeddings()
    plain = type(embedding) is torch.nn.Embedding or type(embedding).__name__ in SCALED_EMBEDDINGS
    if not plain or getattr(inner, "norm", None) is None:
        return "its embedding or final norm is not a plain one"
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return "its LM head is not an nn.Linear"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        routed = routed_experts(mlp)
        attention, feedforward = _projection_names(attn, mlp)
        linear = getattr(layer, "linear_attn", None)
        if linear is not None:
            reason = _delta_net_reason(linear)
            if reason:
                return reason
            attn, attention = linear, DELTA_NET_PARTS
        feedforward = () if routed is not None else feedforward
        projections = [getattr(attn, n, None) for n in attention] + [getattr(mlp, n, None) for n in feedforward]
        for proj in projections:
            reason = _projection_reason(proj)
            if reason:
                return reason
        if routed is not None and not hasattr(_unwrapped(routed)[0], "is_transposed"):
            return "its experts are not a transformers experts module (use_experts_implementation)"
        if any(getattr(getattr(mlp, n), "bias", None) is not None for n in feedforward):
            return "its MLP has biases"
        if routed is None and not _is_silu(_activation(mlp)) and type(_activation(mlp)).__name__ not in TANH_GELUS:
            return "its MLP activation is neither SiLU nor tanh-approximated GELU"
        outputs_normed = _norms_outputs_only(layer)
        norms = [getattr(layer, "post_attention_layernorm", None)]
        norms += [] if outputs_normed else [getattr(layer, "input_layernorm", None)]
        norms += [getattr(layer, n) for n in OUTPUT_NORM_NAMES if hasattr(layer, n)]
        q_norm, k_norm = _head_norms(attn)
        norms += [n for n in (q_norm, k_norm, getattr(linear, "norm", None)) if n is not None]
        if any(n is None or _norm_eps(n) is None for n in norms):
            return "its layer norms are not RMSNorms with an eps"
        if not outputs_normed and hasattr(layer, "pre_feedforward_layernorm") != hasattr(
            layer, "post_feedforward_layernorm"
        ):
            return "its layers norm the MLP's input or output, not both"
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if q_norm is not None and q_norm.weight.shape[0] not in (head_dim, config.num_attention_heads * head_dim):
            return "its q/k norms span neither a head nor the whole projection"
    weights = model.get_input_embeddings().weight
    if check_dtype and weights.dtype != torch.float32:
        return f"its weights are {weights.dtype} (the probe checks fp32 weights only)"
    return None


def _projection_names(attn: torch.nn.Module | None, mlp: torch.nn.Module | None) -> tuple[tuple[str, ...], ...]:
    """A layer's projections by name: Llama's, or Phi-3's stacked q/k/v and gate/up."""
    attention = ("qkv_proj", "o_proj") if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj", "o_proj")
    feedforward = (
        ("gate_up_proj", "down_proj") if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj", "down_proj")
    )
    return attention, feedforward


def _head_norms(attention: torch.nn.Module | None) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """A layer's q and k norms: Qwen3's (q_norm, k_norm, before RoPE), HunYuan's (query_layernorm, key_layernorm,
    after it), or none."""
    if hasattr(attention, "query_layernorm"):
        return attention.query_layernorm, attention.key_layernorm
    return getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)


def _delta_net_reason(linear: torch.nn.Module) -> str | None:
    """None if a linear-attention mixer is Qwen3.5's gated delta rule as delta_rule.py computes it."""
    needed = (*DELTA_NET_PARTS, "conv1d", "A_log", "dt_bias", "norm", "num_k_heads", "num_v_heads")
    if any(not hasattr(linear, n) for n in needed) or getattr(linear, "activation", None) not in ("silu", "swish"):
        return f"its linear-attention layers ({type(linear).__name__}) are not Qwen3.5's gated delta rule"
    if type(linear.conv1d) is not torch.nn.Conv1d:
        return f"its linear attention's convolution is a {type(linear.conv1d).__name__}, not an nn.Conv1d"
    if getattr(linear.norm, "activation", "silu") not in ("silu", "swish"):
        return "its linear attention's gated norm is not SiLU-gated"
    return None


def _output_norms(layer: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The norms of a layer's attention output and MLP output, before their residual adds (None, None: Llama's
    layout): Gemma's and OLMo 2 / 3's (post_attention_layernorm, post_feedforward_layernorm), GLM-4's
    (post_self_attn_layernorm, post_mlp_layernorm; its post_attention_layernorm norms the MLP's input, as Llama's)."""
    if hasattr(layer, "post_mlp_layernorm"):
        return layer.post_self_attn_layernorm, layer.post_mlp_layernorm
    if hasattr(layer, "pre_feedforward_layernorm") or _norms_outputs_only(layer):
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return None, None


def _norms_outputs_only(layer: torch.nn.Module) -> bool:
    """Whether a layer norms its attention's and its MLP's outputs and not their inputs (OLMo 2 / 3)."""
    return getattr(layer, "input_layernorm", None) is None and not hasattr(layer, "pre_feedforward_layernorm")


def routed_experts(mlp: torch.nn.Module | None) -> torch.nn.Module | None:
    """A mixture-of-experts block's experts (None for a dense MLP)."""
    return getattr(mlp, "experts", None)


def _activation(mlp: torch.nn.Module | None) -> object:
    return getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))  # Phi-3's name


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

    Build it once per generate call, after the prefill: it copies the weights as they are then. `pack`: bf16 CPU
    weights may be packed for oneDNN (`packs_weights`); a step that torch.compile traces takes plain ones.
    """

    def __init__(self, model: torch.nn.Module, pack: bool = True):
        inner, config = text_decoder(model)
        device = model.get_input_embeddings().weight.device
        self.device_type = device.type
        self.autocast = autocast = torch.is_autocast_enabled(device.type)
        self.residual_dtype = model.get_input_embeddings().weight.dtype
        self.dtype = torch.get_autocast_dtype(device.type) if autocast else self.residual_dtype
        self.packed = pack and packs_weights(self.dtype, device)
        self.layer_step = type(self)._layer  # (self, ...) -> ...: static_decode may put a compiled one here
        self.mlp_transposed = not self.packed and mlp_transposed_pays_off(device)
        self.adds_promoted = torch.promote_types(self.residual_dtype, self.dtype) == self.residual_dtype
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        # Gemma scales scores by query_pre_attn_scalar**-0.5, not head_dim's
        attention = next((layer.self_attn for layer in inner.layers if hasattr(layer, "self_attn")), None)
        self.scaling = getattr(attention, "scaling", self.head_dim**-0.5)
        self.gemma_norms = type(inner.norm).__name__ in GEMMA_NORMS
        dense = [layer.mlp for layer in inner.layers if routed_experts(layer.mlp) is None]
        self.activation = (
            F.silu if not dense or _is_silu(_activation(dense[0])) else functools.partial(F.gelu, approximate="tanh")
        )
        embedding = model.get_input_embeddings()
        # Gemma scales the embeddings by sqrt(hidden), rounded to the weights' dtype (as its embedding does)
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = None if scale is None else scale.to(embedding.weight.dtype)
        # Granite's multipliers (Python floats, as its forward applies them): of the embeddings, of each layer's
        # attention and MLP outputs before their residual adds, and a divisor of the logits
        self.embedding_multiplier = getattr(inner, "embedding_multiplier", None)
        self.residual_multiplier = getattr(inner.layers[0], "residual_multiplier", None)
        self.logits_scaling = getattr(config, "logits_scaling", None)
        self.rotary, self.rope_tables = inner.rotary_emb, {}
        self.rope_by_layer_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        # Qwen3.5's multimodal RoPE takes a position for each of its three axes; a text token has the same on each
        self.rope_axes = 3 if hasattr(self.rotary, "mrope_section") else None
        self.rope_interleaved = _rotates_interleaved_pairs(attention)
        self.embedding = embedding.weight.detach()
        self.layers = [self._gather(layer, config, kind) for layer, kind in zip(inner.layers, layer_kinds(config))]
        self.windows = [layer.window for layer in self.layers]  # what a StaticKVCache for these layers masks
        self.rope_kinds = sorted({layer.rope for layer in self.layers if layer.rope is not None})
        # GPT-OSS's rotary embedding gives each frequency's cos and sin once, for the two halves it turns against
        # each other, where the others repeat them for the two halves (transformers' rotate_half layout)
        at_one = torch.ones(1, dtype=torch.long, device=device)
        given = self._rope(at_one, self.rope_kinds[0], as_given=True)[0] if self.rope_kinds else None
        self.rope_halves = given is not None and not _repeats_halves(given)
        # the dimensions RoPE rotates: all of a head's, or its first ones (Phi-3's partial_rotary_factor); the rest
        # pass through unrotated
        probe = torch.zeros(1, dtype=torch.long, device=device)
        self.rotary_dim = self._rope(probe, self.rope_kinds[0])[0].shape[-1] if self.rope_kinds else self.head_dim
        self.final_norm, self.final_eps = self._norm_weight(inner.norm), _norm_eps(inner.norm)
        head = model.get_output_embeddings()
        head_dtype = torch.float32 if runs_head_in_fp32(head) else self.dtype
        weight, bias = _linear_weight(head)
        self.head = self._packed([(weight.to(head_dtype), None if bias is None else bias.to(head_dtype))])

    def _gather(self, layer: torch.nn.Module, config: Any, kind: str) -> _Layer:
        attn, mlp = getattr(layer, "self_attn", None), layer.mlp
        attention, feedforward = _projection_names(attn, mlp)  # stacked ones (Phi-3) are one product as they are
        routed = routed_experts(mlp) is not None
        delta = None if kind != LINEAR_ATTENTION else self._delta_net(layer.linear_attn)
        if delta is not None:
            attn, attention = layer.linear_attn, DELTA_NET_PARTS
        *qkv, o = (_linear_weight(getattr(attn, n)) for n in attention)
        gated = delta is None and len(qkv) == 3 and qkv[0][0].shape[0] == 2 * self.heads * self.head_dim
        if gated:  # each head's q, then its gate: the gate's rows go after v, so q, k and v stay as in the others
            q, gate = (self._head_halves(qkv[0], half) for half in (0, 1))
            qkv = [q, *qkv[1:], gate]
        *gate_up, down = [None] if routed else (_linear_weight(getattr(mlp, n)) for n in feedforward)
        q_norm, k_norm = _head_norms(attn)
        # Gemma's post_attention_layernorm norms the attention's output; its pre_feedforward_layernorm is the
        # MLP-input norm that Llama calls post_attention_layernorm. OLMo 2 / 3 norm the outputs only.
        gemma, outputs_only = hasattr(layer, "pre_feedforward_layernorm"), _norms_outputs_only(layer)
        input_norm = None if outputs_only else layer.input_layernorm
        # Mistral's attention reads its window from the config, for every layer (it names no layer types); a full
        # layer has none, whatever its attention keeps (EXAONE 4's keeps the config's window in every layer), nor has
        # a linear-attention one
        windowless = kind in (FULL, LINEAR_ATTENTION)
        window = None if windowless else getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
        mlp_input_norm = (
            None if outputs_only else (layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm)
        )
        attention_out_norm, mlp_out_norm = _output_norms(layer)
        return _Layer(
            input_norm=None if input_norm is None else self._norm_weight(input_norm),
            input_eps=None if input_norm is None else _norm_eps(input_norm),
            qkv=self._product(qkv),
            gated=gated,
            delta=delta,
            q_norm=None if q_norm is None else self._norm_weight(q_norm),
            k_norm=None if k_norm is None else self._norm_weight(k_norm),
            head_eps=None if q_norm is None else _norm_eps(q_norm),
            norm_after_rope=hasattr(attn, "query_layernorm"),
            rope=None if delta is not None or _skips_rope(attn) else self._rope_key(kind),
            window=window,
            sinks=None if getattr(attn, "sinks", None) is None else attn.sinks.detach(),
            o=self._product([o]),
            attention_out_norm=None if attention_out_norm is None else self._norm_pair(attention_out_norm),
            post_norm=None if mlp_input_norm is None else self._norm_weight(mlp_input_norm),
            post_eps=None if mlp_input_norm is None else _norm_eps(mlp_input_norm),
            gate_up=[] if routed else self._product(gate_up),
            down=[] if routed else self._product([down]),
            experts=self._experts(mlp) if routed else None,
            mlp_out_norm=None if mlp_out_norm is None else self._norm_pair(mlp_out_norm),
        )

    def _head_halves(self, pair: tuple[torch.Tensor, torch.Tensor | None], half: int) -> tuple[torch.Tensor, Any]:
        """The rows (and bias) of each head's first or second half of a projection whose heads hold two (q, gate)."""
        weight, bias = pair
        rows = weight.view(self.heads, 2, self.head_dim, -1)[:, half].reshape(self.heads * self.head_dim, -1)
        return rows, None if bias is None else bias.view(self.heads, 2, self.head_dim)[:, half].reshape(-1)

    def _rope_key(self, kind: str) -> str:
        return kind if self.rope_by_layer_type else ONE_ROPE

    def _delta_net(self, linear: torch.nn.Module) -> DeltaNet:
        """A gated delta-rule layer's constants; its convolution's weight rounded to the products' dtype (a bf16 conv1d
        under autocast multiplies bf16 copies), held in fp32, where the step convolves."""
        bias = linear.conv1d.bias
        return DeltaNet(
            conv_weight=linear.conv1d.weight.detach()[:, 0].to(self.dtype).float(),
            conv_bias=None if bias is None else bias.detach().to(self.dtype).float(),
            decay_rate=-linear.A_log.detach().float().exp(),
            dt_bias=linear.dt_bias.detach(),
            norm_weight=linear.norm.weight.detach(),
            norm_eps=_norm_eps(linear.norm),
            key_heads=linear.num_k_heads,
            key_dim=linear.head_k_dim,
            value_heads=linear.num_v_heads,
            value_dim=linear.head_v_dim,
        )

    def _norm_weight(self, norm: torch.nn.Module) -> torch.Tensor:
        """What a norm multiplies by: its weight, or Gemma's (1 + weight) in fp32."""
        weight = norm.weight.detach()
        return 1.0 + weight.float() if self.gemma_norms else weight

    def _norm_pair(self, norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
        return self._norm_weight(norm), _norm_eps(norm)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension: as the model's norm computes it (Gemma's in fp32, rounded once)."""
        if self.gemma_norms:
            return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def _product(self, pairs: Product) -> Product:
        """The weights in the products' dtype. Where that takes a cast (a copy anyway) they are stacked into one
        product; weights already in it are used as they are, with no copy (in fp32 stacking gained nothing:
        58 vs 61 ms a W5 step)."""
        if all(weight.dtype == self.dtype for weight, _ in pairs) or len(pairs) == 1:
            return self._packed([(w.to(self.dtype), None if b is None else b.to(self.dtype)) for w, b in pairs])
        bias = None if pairs[0][1] is None else torch.cat([b for _, b in pairs]).to(self.dtype)
        return self._packed([(torch.cat([w for w, _ in pairs]).to(self.dtype), bias)])

    def _packed(self, product: Product) -> Product:
        """bf16 weights reordered once for oneDNN (`pack_weight`); others as they are."""
        if not self.packed:
            return product
        return [(pack_weight(w), b) if w.dtype == torch.bfloat16 else (w, b) for w, b in product]

    def _outputs(self, x: torch.Tensor, product: Product) -> list[torch.Tensor]:
        x = x.to(product[0][0].dtype)
        return [
            packed_linear(x, weight, bias) if weight.is_mkldnn else few_row_linear(x, weight, bias)
            for weight, bias in product
        ]

    def _apply(self, x: torch.Tensor, product: Product) -> torch.Tensor:
        outs = self._outputs(x, product)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _rope(
        self, positions: torch.Tensor, kind: str = ONE_ROPE, as_given: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sign-folded sin at `positions` (R,), each (R, 1, D) in the residual stream's dtype, as the
        model's rotary embedding gives them for layers of RoPE `kind` (a layer type, where they differ):
        rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2), one cat of x. Given once for both halves
        (`rope_halves`), they are repeated for each (unless `as_given`)."""
        by_type = (kind,) if self.rope_by_layer_type else ()
        at = positions[:, None] if self.rope_axes is None else positions[None, :, None].expand(self.rope_axes, -1, -1)
        cos, sin = self.rotary(self.embedding[:1], at, *by_type)  # its dtype: the hidden states'
        if as_given:
            return cos, sin
        if self.rope_halves:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        half = cos.shape[-1] // 2
        if self.rope_interleaved:  # each frequency for a pair of neighbours: (x0, x1) -> (-x1 sin, x0 sin) added
            cos, sin = cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half]
            return cos.to(self.residual_dtype), torch.stack([-sin, sin], dim=-1).flatten(-2).to(self.residual_dtype)
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos.to(self.residual_dtype), signed_sin.to(self.residual_dtype)

    def tabulate_rope(self, positions: int) -> None:
        """Steps gather RoPE's values for positions below `positions` from a table made once (one kernel a step
        instead of about ten), computed by the model's own rotary embedding. For a loop whose positions stay below
        it, with a RoPE whose values depend on their own position only (static_decode.STATIC_ROPE_TYPES; longrope's
        short factors too, which hold below its pretraining length: `position_limit`)."""
        every = torch.arange(positions, device=self.embedding.device)
        for kind in self.rope_kinds:
            self.rope_tables[kind] = torch.cat(self._rope(every, kind), dim=1)  # (positions, 2, D)

    def _rope_at(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`_rope`'s values for a step at `positions`, gathered from the table where `tabulate_rope` made one."""
        if kind not in self.rope_tables:
            return self._rope(positions, kind)
        both = self.rope_tables[kind].index_select(0, positions)
        return both[:, :1], both[:, 1:]

    def _residual(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """hidden + out in the residual stream's dtype; the add promotes a bf16 `out` itself (no cast kernel)."""
        if self.residual_multiplier is not None:
            out = out * self.residual_multiplier
        return hidden + (out if self.adds_promoted else out.to(self.residual_dtype))

    @contextlib.contextmanager
    def active(self, cache: StaticKVCache, longest: int) -> Iterator[None]:
        """The block a call's steps over `cache` run in (ModelStep's interface): RoPE tabulated for `longest`
        positions, at most the cache's columns."""
        self.tabulate_rope(min(cache.valid.shape[1], longest))
        yield

    @torch.no_grad()
    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: SharedPrefixCache | StaticKVCache
    ) -> torch.Tensor:
        """tokens, positions: (R,) -> fp32 logits (R, vocab); writes the step's keys and values into `cache`."""
        with torch.autocast(self.device_type, enabled=False):  # the products' dtype is set by the weights
            return self._step(tokens, positions, cache)

    def _step(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: SharedPrefixCache | StaticKVCache
    ) -> torch.Tensor:
        # On a GPU a decode step costs about its kernel count (each a few microseconds, the products included), so
        # a dtype changes only where the model's forward rounds, and inside an operator that runs anyway: RoPE
        # computes in the residual stream's dtype, as transformers' (q in the products' dtype times cos/sin in the
        # hidden states'), writing its output in the cache's dtype (under autocast, the bf16 sdpa's inputs); the
        # attention's output stays in that dtype for the o product, and the residual adds promote the products'
        # outputs. bench/bench_decode_ops.py counts the step's operators.
        hidden = F.embedding(tokens, self.embedding)  # (R, H), the residual stream
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        ropes = {None: (None, None), **{kind: self._rope_at(positions, kind) for kind in self.rope_kinds}}
        mlp_out = None
        for index, layer in enumerate(self.layers):
            hidden, mlp_out = self.layer_step(self, hidden, mlp_out, layer, cache.layer(index), *ropes[layer.rope])
        hidden = self._norm(self._residual(hidden, mlp_out), self.final_norm, self.final_eps)
        logits = self._apply(hidden, self.head)
        return (logits if self.logits_scaling is None else logits / self.logits_scaling).float()

    def _layer(
        self,
        hidden: torch.Tensor,
        mlp_out: torch.Tensor | None,
        layer: _Layer,
        cache: StaticLayerCache | SharedPrefixLayer | StaticStateLayer,
        cos: torch.Tensor | None,
        signed_sin: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: (the residual stream before it, the previous layer's MLP output or None) -> (the stream after
        its attention, its MLP output). Each layer adds the previous one's MLP output itself, so a compiled layer
        (static_decode's compile) fuses that add with its first norm."""
        if mlp_out is not None:
            hidden = self._residual(hidden, mlp_out)
        x = hidden if layer.input_norm is None else self._norm(hidden, layer.input_norm, layer.input_eps)
        if layer.delta is None:
            out = self._attention(x, layer, cache, cos, signed_sin)
        else:
            out = self._apply(self._delta_rule(x, layer, cache), layer.o)
        if layer.attention_out_norm is not None:
            out = self._norm(out, *layer.attention_out_norm)
        hidden = self._residual(hidden, out)
        x = hidden if layer.post_norm is None else self._norm(hidden, layer.post_norm, layer.post_eps)
        out = self._mlp(x, layer)
        return hidden, out if layer.mlp_out_norm is None else self._norm(out, *layer.mlp_out_norm)

    def _attention(
        self,
        x: torch.Tensor,
        layer: _Layer,
        cache: StaticLayerCache | SharedPrefixLayer,
        cos: torch.Tensor | None,
        signed_sin: torch.Tensor | None,
    ) -> torch.Tensor:
        """A layer's attention over its cache, from its normed input to its o product's output."""
        rows, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.head_dim
        attention_dtype = cache.kv_dtype
        rot, q_width = self.rotary_dim, heads * dim
        half = rot // 2
        outs = self._outputs(x, layer.qkv)  # one stacked product, or q, k and v (and a gate) read in place
        qkv = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).view(rows, -1, dim)
        # RoPE's output replaces q and k in place where the products' dtype is the cache's (the static loop's),
        # so the cache takes k and v in one write; else (the engine's fp32 cache under autocast) a buffer does
        rotated = qkv if qkv.dtype == attention_dtype else torch.empty_like(qkv, dtype=attention_dtype)
        qk = qkv[:, : heads + kv_heads]  # `qk * cos` below computes in the residual stream's dtype
        if rotated is not qkv:
            rotated[:, heads + kv_heads :] = qkv[:, heads + kv_heads :]
        normed_after = layer.norm_after_rope and layer.rope is not None
        if layer.q_norm is not None and not normed_after:
            qk = self._qk_normed(qk, layer)
        # q and k no longer where RoPE writes its output
        moved = rotated is not qkv or (layer.q_norm is not None and not normed_after)
        if layer.rope is None:  # q and k as they are, into the attention's dtype
            if moved:
                rotated[:, : heads + kv_heads] = qk
        else:
            if rot < dim and moved:  # the dimensions RoPE leaves alone
                rotated[:, : heads + kv_heads, rot:] = qk[..., rot:]
            turned = qk[..., :rot]
            if self.rope_interleaved:  # each pair's neighbours swapped
                swapped = turned.unflatten(-1, (half, 2)).flip(-1).flatten(-2)
            else:  # the halves swapped
                swapped = torch.cat([turned[..., half:], turned[..., :half]], dim=-1)
            # rounded once, into the attention's dtype, as the training forward's autocast rounds RoPE's output; the
            # inputs are computed before the output overwrites q and k
            rope_inputs = (turned * cos, swapped, signed_sin)
            if normed_after:  # HunYuan: q and k normed per head after RoPE, in its dtype, then rounded
                roped = torch.addcmul(*rope_inputs)
                if rot < dim:
                    roped = torch.cat([roped, qk[..., rot:].to(roped.dtype)], dim=-1)
                rotated[:, : heads + kv_heads] = self._qk_normed(roped, layer)
            elif torch.compiler.is_compiling():  # dynamo refuses a strided `out=`; inductor fuses the copy anyway
                rotated[:, : heads + kv_heads, :rot] = torch.addcmul(*rope_inputs)
            else:
                torch.addcmul(*rope_inputs, out=rotated[:, : heads + kv_heads, :rot])
        cache.write(rotated[:, heads : heads + 2 * kv_heads, None])  # (R, 2 * kv_heads, 1, D): keys, then values
        query = rotated[:, :heads, None]
        if layer.sinks is None:
            attended = cache.attend(query, self.scaling)  # (R, 1, heads, D)
        else:
            attended = cache.attend_eager(query, self.scaling, sinks=layer.sinks)
        attended = attended.reshape(rows, q_width)
        if layer.gated:  # times the gate, in the products' dtype, as the forward's sigmoid(gate)
            attended = attended * torch.sigmoid(qkv[:, heads + 2 * kv_heads :].reshape(rows, q_width))
        return self._apply(attended, layer.o)

    def _qk_normed(self, qk: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """q and k (rows, heads + kv_heads, head_dim) through the layer's q and k norms: Gemma's in fp32, rounded to
        `qk`'s dtype; the others in the residual stream's dtype, per head (Qwen3) or over the whole projection
        (OLMo 2 / 3)."""
        rows, heads, kv_heads, dim = qk.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.gemma_norms:
            q = self._norm(qk[:, :heads], layer.q_norm, layer.head_eps)
            return torch.cat([q, self._norm(qk[:, heads:], layer.k_norm, layer.head_eps)], dim=1)
        rope_dtype = self.residual_dtype
        qk = qk.to(rope_dtype)
        q, k = qk[:, :heads], qk[:, heads:]
        if layer.q_norm.shape[0] == dim:
            q = F.rms_norm(q, (dim,), layer.q_norm.to(rope_dtype), layer.head_eps)
            k = F.rms_norm(k, (dim,), layer.k_norm.to(rope_dtype), layer.head_eps)
        else:
            q = F.rms_norm(q.reshape(rows, -1), (heads * dim,), layer.q_norm.to(rope_dtype), layer.head_eps)
            k = F.rms_norm(k.reshape(rows, -1), (kv_heads * dim,), layer.k_norm.to(rope_dtype), layer.head_eps)
            q, k = q.view(rows, heads, dim), k.view(rows, kv_heads, dim)
        return torch.cat([q, k], dim=1)

    def _delta_rule(self, x: torch.Tensor, layer: _Layer, cache: StaticStateLayer) -> torch.Tensor:
        """A linear-attention layer's gated delta rule at one token (delta_rule.py), its states in `cache`, from its
        normed input to its out projection's input."""
        delta = layer.delta
        key_width, value_width = delta.key_heads * delta.key_dim, delta.value_heads * delta.value_dim
        projected = self._apply(x, layer.qkv)  # q/k/v, z, b and a: one stacked product where the weights are cast
        mixed, z, b, a = projected.split([2 * key_width + value_width, value_width, *(2 * [delta.value_heads])], -1)
        return delta_net_step(delta, mixed, z, b, a, cache.conv_state, cache.recurrent_state)

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """down(act(gate) * up) of the normed (R, H) rows (act: SiLU, or Gemma's tanh-approximated GELU); a layer of
        routed experts runs the model's own block (`_routed`)."""
        if layer.experts is not None:
            return self._routed(x, layer.experts)
        if self.mlp_transposed and len(layer.gate_up) == 1:
            # gate/up stacked in one weight: the (2I, R) product W @ x^T has each half contiguous, where the halves of
            # x @ W^T's (R, 2I) are strided, which CUDA's SiLU and product run by its generic elementwise kernel
            # (indexing every element: ~6 us each a layer on an H200, against ~2 for a contiguous operand). The
            # transposes are operand layouts of the products, not copies.
            weight, _ = layer.gate_up[0]  # an MLP has no biases (structure_reason)
            gate, up = torch.mm(weight, x.to(weight.dtype).t()).chunk(2, dim=0)
            return self._apply(self.activation(gate).mul_(up).t(), layer.down)
        outs = self._outputs(x, layer.gate_up)
        gate, up = outs if len(outs) == 2 else outs[0].chunk(2, dim=-1)
        return self._apply(self.activation(gate) * up, layer.down)

    def _experts(self, block: torch.nn.Module) -> _Experts:
        """A layer's experts with the weights they apply (LoRA adapters on their parameters added, as for the dense
        products: `_linear_weight`) in the products' dtype: copies where that takes one, none where they are in it
        and unadapted, read in place. transformers' grouped_mm experts multiply in the weights' dtype, and on CUDA
        only bf16 runs without a host sync."""
        experts, wrappers = _unwrapped(block.experts)
        prefix = "experts" + ".base_layer" * len(wrappers)
        weights = {name: weight.detach() for name, weight in experts.named_parameters(recurse=False)}
        for wrapper in wrappers:
            if wrapper.merged or wrapper.disable_adapters:
                continue
            for adapter in (a for a in wrapper.active_adapters if a in wrapper.lora_A):
                weight = weights[wrapper.parameter_name]
                weights[wrapper.parameter_name] = weight + wrapper.get_delta_weight(adapter).detach().to(weight.dtype)
        if not wrappers and all(weight.dtype == self.dtype for weight in weights.values()):
            return _Experts(block, {}, [])
        return _Experts(block, {f"{prefix}.{n}": w.to(self.dtype) for n, w in weights.items()}, wrappers)

    def _routed(self, x: torch.Tensor, experts: _Experts) -> torch.Tensor:
        """The model's own mixture-of-experts block on the normed (R, H) rows, under the autocast the decoder was
        built in: its router, top-k and experts are transformers' code (its experts implementation), run with the
        model's weights, the experts' as `_experts` gives them (peft's wrappers, whose adapters those include, are
        switched off meanwhile, so that they pass the call to the experts as they are)."""
        block, weights, wrappers = experts
        switched = [wrapper._disable_adapters for wrapper in wrappers]
        for wrapper in wrappers:
            wrapper._disable_adapters = True
        try:
            with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast):
                out = torch.func.functional_call(block, weights, (x[:, None],)) if weights else block(x[:, None])
        finally:
            for wrapper, off in zip(wrappers, switched):
                wrapper._disable_adapters = off
        return (out[0] if isinstance(out, tuple) else out)[:, 0]  # some blocks also return their router's logits


def _unwrapped(experts: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """An experts module under peft's LoRA wrappers of its parameters (`target_parameters`, one a parameter, nested),
    and those wrappers, outermost first."""
    wrappers = []
    while hasattr(experts, "parameter_name") and hasattr(experts, "base_layer"):
        wrappers.append(experts)
        experts = experts.base_layer
    return experts, wrappers


def _skips_rope(attention: torch.nn.Module) -> bool:
    """Whether a layer's attention leaves q and k unrotated: SmolLM3's NoPE layers (`use_rope`), EXAONE 4's full
    layers in a model with sliding ones (its attention rotates where `sliding_window is None or is_sliding`)."""
    if not getattr(attention, "use_rope", True):
        return True
    return getattr(attention, "is_sliding", True) is False and getattr(attention, "sliding_window", None) is not None


def _rotates_interleaved_pairs(attention: torch.nn.Module | None) -> bool:
    """Whether the model's RoPE turns each pair of neighbouring dimensions (GLM, GLM-4: its module's `rotate_half`
    takes x[0::2] and x[1::2]) rather than the two halves of the rotated dimensions, told by the module's own
    function."""
    rotate = getattr(inspect.getmodule(type(attention)), "rotate_half", None)
    if rotate is None:
        return False
    return torch.equal(rotate(torch.arange(4.0)), torch.tensor([-1.0, 0.0, -3.0, 2.0]))


def _repeats_halves(cos: torch.Tensor) -> bool:
    """Whether a rotary embedding's cos at a position holds each frequency twice, once for each half it turns."""
    half = cos.shape[-1] // 2
    return cos.shape[-1] % 2 == 0 and torch.equal(cos[..., :half], cos[..., half:])


def position_limit(model: torch.nn.Module) -> tuple[int, str] | None:
    """The longest sequence whose decode steps FusedDecoder computes as the model's forward does, and what changes
    past it (None: no limit):
    - a longrope model (Phi-3.5, Phi-4-mini) rotates with its short factors up to its pretraining length; transformers
      takes the long ones for every position of a forward whose largest position passes it, and on the step where
      generate's sequences pass it, drops the cache and encodes them again;
    - Ministral 3 scales its queries by 1 + beta log(1 + floor(position / original length)) (`llama_4_scaling_beta`),
      exactly 1 below that length, where the step need not.
    The samplers fuse steps only for calls that stay within it."""
    inner, config = text_decoder(model)
    rotary = getattr(inner, "rotary_emb", None)
    kinds = getattr(rotary, "rope_type", None)
    parameters = getattr(getattr(rotary, "config", config), "rope_parameters", None) or {}
    original = getattr(config, "original_max_position_embeddings", None) or parameters.get(
        "original_max_position_embeddings"
    )
    if "longrope" in (kinds.values() if isinstance(kinds, dict) else [kinds]):
        return int(original), f"the pretraining length of the model's longrope ({int(original)})"
    if parameters.get("llama_4_scaling_beta"):
        return int(original), f"{int(original)} positions, past which the model scales its queries by position"
    return None


def text_decoder(model: torch.nn.Module) -> tuple[torch.nn.Module | None, Any]:
    """The decoder stack under a causal LM (`model.model`) and its config; for a vision-language model that keeps its
    language model apart (Gemma 3 4B and up, LLaVA: `model.model.language_model`), that one and its text config:
    what text-only prompts run through."""
    inner, config = getattr(model, "model", None), getattr(model, "config", None)
    language = getattr(inner, "language_model", None)
    if language is not None and config is not None:
        return language, config.get_text_config()
    return inner, config


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (its LoRA layers stay in place), or `model` itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def fuses(model: torch.nn.Module) -> bool:
    """Whether FusedDecoder may run `model`'s decode steps: decided once per model, the verdict logged once."""
    target = _base(model)
    if target not in _VERDICTS:
        reason = structure_reason(target) or probe(target)
        _VERDICTS[target] = reason
        name = type(target).__name__
        if reason is None:
            logger.info(f"grouprl: fused decode steps are on for {name}.")
        else:
            logger.info(f"grouprl: fused decode steps are off for {name}: {reason}. Decode steps run its forward.")
    return _VERDICTS[target] is None


def fuses_up_to(model: torch.nn.Module, longest: int) -> bool:
    """`fuses`, for a call whose sequences reach `longest` tokens: within the model's `position_limit`."""
    limit = position_limit(_base(model))
    return (limit is None or longest <= limit[0]) and fuses(model)


def fused_decoder(model: torch.nn.Module) -> FusedDecoder:
    """A FusedDecoder with `model`'s weights as they are now (call `fuses` first)."""
    return FusedDecoder(_base(model))


def layer_kinds(config: Any) -> list[str]:
    """Each layer's attention type: config.layer_types, or, for a config that names none, a sliding window in every
    layer where config.sliding_window is set (Mistral)."""
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    return [FULL if not getattr(config, "sliding_window", None) else "sliding_attention"] * config.num_hidden_layers


def static_cache_only(model: torch.nn.Module) -> bool:
    """Whether FusedDecoder runs `model`'s steps over a static cache only: some layer attends over a sliding window,
    or is a linear-attention layer (shared-prefix decoding serves neither)."""
    config = text_decoder(model)[1]
    kinds = layer_kinds(config)
    windowed = getattr(config, "sliding_window", None) is not None and any(
        k not in (FULL, LINEAR_ATTENTION) for k in kinds
    )
    return windowed or LINEAR_ATTENTION in kinds


@torch.no_grad()
def probe(model: torch.nn.Module) -> str | None:
    """None if FusedDecoder's steps give the model's own logits (fp32, through the same shared-prefix cache; a model
    with sliding windows or linear attention through the static cache, against its forward over its own cache)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    prompts = torch.tensor([[0, 3, 5, 7], [2, 4, 6, 8]], device=device) % vocab
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], device=device)
    steps = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], device=device) % vocab
    forward = functools.partial(type(model).forward, model)  # the class forward (module doc)
    # in eval mode, as generation runs: a training model with gradient checkpointing keeps no cache (transformers 5.17)
    was_training = model.training
    model.eval()
    with torch.autocast(device.type, enabled=False):
        try:
            if static_cache_only(model):
                expected, got = static_decode_pair(model, prompts, mask, steps)
            else:
                expected = shared_decode(model, prompts, mask, steps, forward=forward)
                got = _fused_decode(model, prompts, mask, steps)
        except Exception as err:
            if not is_unsupported(err):
                raise
            return f"the probe's fused step failed: {describe(err)}"
        finally:
            model.train(was_training)
    for want, have in zip(expected, got):
        gap, allowed = float((have - want.reshape(have.shape)).abs().max()), logit_tolerance(want, noise=0.0)
        if gap > allowed:
            return f"the probe's fused logits differ from its forward by up to {gap:.3g} (allowed {allowed:.3g})"
    return None


def _fused_decode(
    model: torch.nn.Module, prompts: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor
) -> list[torch.Tensor]:
    """Each step's fp32 logits (rows, vocab) from FusedDecoder, `SAMPLES` per prompt over one shared-prefix cache
    prefilled by the model's class forward (module doc)."""
    forward = functools.partial(type(model).forward, model)
    cache = shared_prefill(forward, model.config, prompts, mask, SAMPLES, steps.shape[0])
    decoder = FusedDecoder(model)
    positions = mask.repeat_interleave(SAMPLES, 0).sum(dim=1)
    logits = []
    for step in steps:
        logits.append(decoder.step(step, positions, cache))
        positions = positions + 1
    return logits


def static_decode_pair(
    model: torch.nn.Module, prompts: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each step's fp32 logits (rows, vocab), `SAMPLES` rows per prompt fed `steps`' tokens: (the model's class
    forward over its own cache, FusedDecoder over a StaticKVCache), both prefilled by that forward."""
    forward = functools.partial(type(model).forward, model)
    keyword = cache_keyword(model)
    prompts, mask = prompts.repeat_interleave(SAMPLES, 0), mask.repeat_interleave(SAMPLES, 0)
    positions = mask.sum(dim=1)
    cache = DynamicCache(config=model.config)
    positions_now = position_ids_from_mask(mask)
    forward(input_ids=prompts, attention_mask=mask, position_ids=positions_now, use_cache=True, **{keyword: cache})
    decoder = FusedDecoder(model)
    static = StaticKVCache(cache, mask, 1, steps.shape[0], decoder.dtype, decoder.windows)  # a copy of the prefill's
    expected, got = [], []
    for index, tokens in enumerate(steps):
        mask = F.pad(mask, (0, 1), value=1)
        at = (positions + index)[:, None]
        out = forward(
            input_ids=tokens[:, None], attention_mask=mask, position_ids=at, use_cache=True, **{keyword: cache}
        )
        expected.append(out.logits[:, -1].float())
        static.open_column()
        got.append(decoder.step(tokens, positions + index, static))
        static.column.add_(1)
    return expected, got


def weight_major_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, as (W @ x^T)^T when x has few rows (see the module doc), else `F.linear`."""
    return few_row_linear(x, layer.weight, layer.bias)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, as (W @ x^T)^T when x has few fp32 rows on the CPU and no autograd."""
    if torch.compiler.is_compiling():  # a traced step's shapes may be symbolic; inductor picks its own kernels
        return F.linear(x, weight, bias)
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if (
        rows not in FEW_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, features)
    if rows > UNPADDED_ROWS and rows % 16:  # zero rows up to a multiple of 16 (module doc)
        padded = flat.new_zeros(-(-rows // 16) * 16, features)
        padded[:rows] = flat
        flat = padded
    columns = flat.t()
    if bias is None:
        out = torch.mm(weight, columns)
    else:
        out = torch.addmm(bias[:, None], weight, columns)
    return out[:, :rows].t().contiguous().view(*x.shape[:-1], weight.shape[0])


def mlp_transposed_pays_off(device: torch.device) -> bool:
    """Whether a decode step computes a stacked gate/up product as W @ x^T (`FusedDecoder._mlp`): on CUDA, whose
    elementwise kernels run contiguous operands vectorised. CPUs keep x @ W^T: their products are tuned for it here
    (packed bf16 weights, `few_row_linear`), and their elementwise loops gain little from contiguity."""
    return device.type == "cuda"


def packs_weights(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products in `dtype` on `device` run from packed weights: bf16 on a CPU whose oneDNN runs them."""
    return dtype == torch.bfloat16 and device.type == "cpu" and packed_bf16_runs()


@functools.cache
def packed_bf16_runs() -> bool:
    """Whether oneDNN here multiplies bf16 rows by a packed weight: asked of torch (which knows the CPU and the
    instruction-set limits in force, core/cpu_capabilities.py), then tried once on a tiny weight. Without it (an
    AVX2-only CPU: "bf16 path needs the cpu support ...") the products run through `F.linear`. Logged once."""
    reason = None
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        reason = "this torch build has no oneDNN weight packing"
    elif not onednn_runs_bf16():
        limit = isa_limits().get("ONEDNN_MAX_CPU_ISA")
        held = f"ONEDNN_MAX_CPU_ISA={limit}" if limit else "it needs AVX512BW/VL/DQ or AVX-NE-CONVERT"
        reason = f"oneDNN runs no bf16 products on this CPU ({held})"
    else:
        try:
            packed_linear(
                torch.ones(2, 16, dtype=torch.bfloat16), pack_weight(torch.ones(16, 16, dtype=torch.bfloat16))
            )
        except Exception as err:
            if not is_unsupported(err):
                raise
            reason = f"a packed product failed: {describe(err)}"
    if reason is None:
        logger.info("grouprl: bf16 decode products on the CPU use weights packed once for oneDNN.")
    else:
        logger.info(f"grouprl: bf16 decode products on the CPU use F.linear, not packed weights: {reason}.")
    return reason is None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) bf16 CPU weight reordered once into oneDNN's layout, for `packed_linear` (module doc)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for (rows, in) `x`, with the weight as `pack_weight` returned it."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@contextlib.contextmanager
def weight_major_decode(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's plain `nn.Linear` layers use `weight_major_linear`.

    Subclasses (quantized layers, ...) and layers whose forward is already replaced keep their own.
    A model whose layers are not on the CPU is left alone (no per-call check on a path that never applies).
    """
    layers = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear and "forward" not in vars(m) and m.weight.device.type == "cpu"
    ]
    for layer in layers:
        layer.forward = functools.partial(weight_major_linear, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
