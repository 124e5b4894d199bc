"""The hand-written decode step (`FusedDecoder`), kept only for the model types of `FAMILIES`, where it was measured
faster than decoding through the model's own forward; every other model decodes through its forward (the CPU
engine: engine.py; the captured loop: model_step.ModelStep).

A decode step pushes one token per running sequence through every layer. `FusedDecoder` computes a Llama-layout
layer from its weights with fewer, larger operators than the forward: under autocast it casts each layer's weights
once per generate call, q/k/v stacked into one product and gate/up into another (bf16 CPU weights then packed once
for oneDNN, cpu_products.py); per step RMSNorm -> q/k/v product -> RoPE on q and k together (cos/sin gathered from a
table made once a call) -> the cache's attention -> o product -> RMSNorm -> gate/up product -> act(gate) * up ->
down product, the residual stream in the weights' dtype as in the model.

What differs between the families it runs is data (`Family`): per-head q/k norms (Qwen3-MoE, Gemma 3), Gemma's
scaled embeddings, (1 + w) norms in fp32, normed attention and MLP outputs and tanh GELU, and layers of routed
experts, which run the model's own block (its router, top-k and transformers' experts implementation). Sliding
windows follow the config's layer types (a static cache only). LoRA adapters from peft are added to the weights for
the call.

Trusted by measurement: `structure_reason` checks the model's modules against its row, and the step is admitted only
once it computed as the forward on the model's fp32 twin (decode_probe.verdict), whatever the model's dtype.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from transformers.utils import logging

from grouprl.generation import decode_probe
from grouprl.generation.cpu_products import few_row_linear, pack_weight, packed_linear, packs_weights
from grouprl.generation.shared_prefix import SharedPrefixCache, SharedPrefixLayer
from grouprl.generation.static_kv_cache import StaticKVCache
from grouprl.model.adapters import base_model
from grouprl.model.layer_configs import FULL, layer_kinds
from grouprl.model.loading import runs_head_in_fp32

if TYPE_CHECKING:
    from grouprl.generation.static_kv_cache import StaticLayerCache

logger = logging.get_logger("grouprl")

Product = list[tuple[torch.Tensor, torch.Tensor | None]]  # (weight, bias) pairs whose outputs are concatenated


class Family(NamedTuple):
    """A model type the hand-written step runs: how its layers differ from Llama's, and the measurements that keep
    it, one for each sampler that runs it (None: that sampler decodes through the model's forward)."""

    cpu: Optional[str]  # the CPU engine's (engine.py)
    gpu: Optional[str]  # the captured loop's (static_decode.py)
    head_norms: bool = False  # q and k RMSNormed per head before RoPE (q_norm, k_norm)
    # embeddings times sqrt(hidden); (1 + w) norms in fp32, on the attention's and the MLP's outputs too; tanh GELU
    gemma: bool = False
    experts: bool = False  # layers of routed experts, run as the model's own block


FAMILIES = {
    "llama": Family(
        cpu="SmolLM2-135M (W5) under bf16 autocast: 1.22x the tokens/s (bench/bench_fused_decode.py)", gpu=None
    ),
    "qwen2": Family(
        cpu="W1-W4 under bf16 autocast: 1.18-1.50x the tokens/s (bench/bench_fused_decode.py)",
        gpu="the 0.5B case; to be decided against ModelStep at >= 1.25x (bench/gpu/decode_steps.sh, case 1)",
    ),
    "qwen3_moe": Family(
        cpu=None, gpu="Qwen3-MoE; to be decided at >= 1.25x (decode_steps.sh, case 5)", head_norms=True, experts=True
    ),
    "gemma3_text": Family(
        cpu=None, gpu="Gemma 3; to be decided at >= 1.25x (decode_steps.sh, case 4)", head_norms=True, gemma=True
    ),
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # cos/sin of a position its own: tabulated once a call
ONE_ROPE = "every layer"  # the RoPE table key of a model whose layers share one
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TANH_GELUS = ("GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh")  # gelu_pytorch_tanh's classes across versions

_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


class _Experts(NamedTuple):
    block: torch.nn.Module  # the model's mixture-of-experts block: router, top-k and experts
    weights: dict[str, torch.Tensor]  # the experts' weights substituted, by name in `block` (none: as they are)
    wrappers: list[torch.nn.Module]  # peft's LoRA wrappers of the experts' parameters, passed by while substituted


class _Layer(NamedTuple):
    input_norm: tuple[torch.Tensor, float]  # (what the norm multiplies by, its eps)
    qkv: Product
    q_norm: tuple[torch.Tensor, float] | None  # per head, before RoPE
    k_norm: tuple[torch.Tensor, float] | None
    rope: str  # the RoPE table its q and k take (Gemma 3: one a layer type)
    window: int | None  # a sliding-window layer's window (the static cache's biases; shared prefixes serve none)
    o: Product
    attention_out_norm: tuple[torch.Tensor, float] | None  # Gemma: the attention's output normed before the add ...
    mlp_norm: tuple[torch.Tensor, float]
    gate_up: Product  # empty in a layer of routed experts
    down: Product
    experts: _Experts | None
    mlp_out_norm: tuple[torch.Tensor, float] | None  # ... and so is its MLP's


def text_decoder(model: torch.nn.Module) -> tuple[torch.nn.Module | None, Any]:
    """The decoder stack under a causal LM (`model.model`) and its config; for a vision-language model that keeps its
    language model apart (Gemma 3 4B and up: `model.model.language_model`), that one and its text config: what
    text-only prompts run through."""
    inner, config = getattr(model, "model", None), getattr(model, "config", None)
    language = getattr(inner, "language_model", None)
    if language is not None and config is not None:
        return language, config.get_text_config()
    return inner, config


def family_of(model: torch.nn.Module) -> tuple[str | None, Family | None]:
    """The model type of `model`'s text config and its row of FAMILIES (None: it has none)."""
    model_type = getattr(text_decoder(model)[1], "model_type", None)
    return model_type, FAMILIES.get(model_type)


def routed_experts(mlp: torch.nn.Module | None) -> torch.nn.Module | None:
    """A mixture-of-experts block's experts (None for a dense MLP)."""
    return getattr(mlp, "experts", None)


def _norm_eps(norm: torch.nn.Module | None) -> float | None:
    for name in ("variance_epsilon", "eps"):
        if isinstance(getattr(norm, name, None), float):
            return getattr(norm, name)
    return None


def _linear_weight(proj: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias `proj` applies: a plain nn.Linear's, or a peft LoRA layer's base plus its active,
    unmerged adapters (in eval mode, where LoRA dropout is off)."""
    if type(proj) is torch.nn.Linear:
        return proj.weight.detach(), (None if proj.bias is None else proj.bias.detach())
    weight, bias = _linear_weight(proj.base_layer)
    if getattr(proj, "merged", False) or getattr(proj, "disable_adapters", False):  # merged, or switched off
        return weight, bias
    for adapter in proj.active_adapters:
        if adapter in proj.lora_A:
            weight = weight + proj.get_delta_weight(adapter).detach().to(weight.dtype)
    return weight, bias


def _projection_reason(proj: torch.nn.Module | None) -> str | None:
    if proj is None:
        return "its layers lack Llama's q/k/v/o or gate/up/down projections"
    if type(proj) is torch.nn.Linear:
        return None
    base = getattr(proj, "base_layer", None)
    if base is not None and hasattr(proj, "get_delta_weight") and hasattr(proj, "lora_A"):
        if any(proj.use_dora.get(a, False) for a in proj.active_adapters):
            return "a DoRA adapter is active"
        return _projection_reason(base)
    return f"a projection is a {type(proj).__name__}, not an nn.Linear or a LoRA layer on one"


def structure_reason(model: torch.nn.Module) -> str | None:
    """None if `model`'s modules are what its row of FAMILIES says FusedDecoder runs, else what differs (the probe
    decides whether the step then computes as the forward)."""
    model_type, family = family_of(model)
    if family is None:
        return f"its model type ({model_type!r}) has no row in fused_step.FAMILIES"
    inner, config = text_decoder(model)
    if getattr(inner, "layers", None) is None or getattr(inner, "rotary_emb", None) is None:
        return "not a Llama-layout causal LM (no model.layers / model.rotary_emb)"
    for what in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, what, None) is not None:
            return f"config.{what} is set"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "its RoPE turns part of each head only"
    kinds = set(layer_kinds(config)) - {FULL, "sliding_attention"}
    if kinds:
        return f"its layers of type {sorted(kinds)} are not attention layers"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    for kind in rope.values() if isinstance(rope, dict) else [rope]:  # Gemma 3: one a layer type
        if kind not in ROPE_TYPES:
            return f"its RoPE ({kind!r}) is none of {ROPE_TYPES}"
    embedding = model.get_input_embeddings()
    if type(embedding) is not torch.nn.Embedding and not (family.gemma and hasattr(embedding, "embed_scale")):
        return "its embedding is not a plain one"
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or _norm_eps(getattr(inner, "norm", None)) is None:
        return "its LM head is not an nn.Linear or its final norm not an RMSNorm"
    replaced = next((name for name, m in inner.layers.named_modules() if "forward" in vars(m)), None)
    if replaced is not None:  # the twin the probe checks runs the class's code, the step the weights only
        return f"the forward of its module layers.{replaced} is replaced on the instance, which the step cannot follow"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        routed = routed_experts(mlp) if family.experts else None
        projections = [getattr(attn, n, None) for n in ATTENTION]
        projections += [] if routed is not None else [getattr(mlp, n, None) for n in MLP]
        for proj in projections:
            reason = _projection_reason(proj)
            if reason:
                return reason
        if routed is not None and not hasattr(_unwrapped(routed)[0], "is_transposed"):
            return "its experts are not a transformers experts module (use_experts_implementation)"
        if routed is None:
            if any(getattr(mlp, n).bias is not None for n in MLP):
                return "its MLP has biases"
            activation = type(getattr(mlp, "act_fn", None)).__name__
            if activation not in ((*TANH_GELUS,) if family.gemma else ("SiLU", "SiLUActivation")):
                return f"its MLP's activation ({activation}) is not its family's"
        norm_names = ["input_layernorm", "post_attention_layernorm"]
        norm_names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if family.gemma else []
        norms = [getattr(layer, n, None) for n in norm_names]
        norms += [getattr(attn, n, None) for n in ("q_norm", "k_norm")] if family.head_norms else []
        if any(_norm_eps(n) is None for n in norms):
            return f"its layer norms are not its family's RMSNorms ({', '.join(norm_names)}, q/k norms)"
    return None


def fuses(model: torch.nn.Module) -> bool:
    """Whether the CPU engine may run `model`'s decode steps with FusedDecoder: its row keeps it there, its modules
    match the row and its fp32 twin's steps compute as its forward; decided once per model, the verdict logged once."""
    target = base_model(model)
    if target not in _VERDICTS:
        model_type, family = family_of(target)
        reason = structure_reason(target)
        if reason is None and family.cpu is None:
            reason = f"its row of fused_step.FAMILIES keeps the step for the captured loop only ({model_type})"
        _VERDICTS[target] = reason or decode_probe.verdict(target, "fused", FusedDecoder)
        name = type(target).__name__
        if _VERDICTS[target] is None:
            logger.info(f"grouprl: fused decode steps are on for {name}.")
        else:
            logger.info(
                f"grouprl: fused decode steps are off for {name}: {_VERDICTS[target]}. Decode steps run its forward."
            )
    return _VERDICTS[target] is None


def mlp_transposed_pays_off(device: torch.device) -> bool:
    """Whether a decode step computes a stacked gate/up product as W @ x^T (`FusedDecoder._mlp`): on CUDA, whose
    elementwise kernels run contiguous operands vectorised. CPUs keep x @ W^T: their products are tuned for it here
    (packed bf16 weights, `few_row_linear`), and their elementwise loops gain little from contiguity."""
    return device.type == "cuda"


class FusedDecoder:
    """`step(tokens, positions, cache) -> logits`: one decode step with `model`'s current weights (module doc).

    Build it once per generate call, after the prefill: it copies the weights as they are then. `pack`: bf16 CPU
    weights may be packed for oneDNN (`packs_weights`); a step that torch.compile traces takes plain ones.
    """

    def __init__(self, model: torch.nn.Module, pack: bool = True):
        inner, config = text_decoder(model)
        self.family = family_of(model)[1]
        embedding = model.get_input_embeddings()
        device = embedding.weight.device
        self.device_type = device.type
        self.autocast = autocast = torch.is_autocast_enabled(device.type)
        self.residual_dtype = embedding.weight.dtype
        self.dtype = torch.get_autocast_dtype(device.type) if autocast else self.residual_dtype
        self.packed = pack and packs_weights(self.dtype, device)
        self.layer_step = type(self)._layer  # (self, ...) -> ...: static_decode may put a compiled one here
        self.mlp_transposed = not self.packed and mlp_transposed_pays_off(device)
        self.adds_promoted = torch.promote_types(self.residual_dtype, self.dtype) == self.residual_dtype
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = inner.layers[0].self_attn.scaling  # Gemma's: query_pre_attn_scalar**-0.5
        self.activation = functools.partial(F.gelu, approximate="tanh") if self.family.gemma else F.silu
        # Gemma scales the embeddings by sqrt(hidden), rounded to the weights' dtype (as its embedding does)
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = None if scale is None else scale.to(embedding.weight.dtype)
        self.embedding = embedding.weight.detach()
        self.rotary, self.rope_tables = inner.rotary_emb, {}
        self.rope_by_layer_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.layers = [self._gather(layer, config, kind) for layer, kind in zip(inner.layers, layer_kinds(config))]
        self.windows = [layer.window for layer in self.layers]  # what a StaticKVCache for these layers masks
        self.rope_kinds = sorted({layer.rope for layer in self.layers})
        self.final_norm = self._norm_pair(inner.norm)
        head = model.get_output_embeddings()
        head_dtype = torch.float32 if runs_head_in_fp32(head) else self.dtype
        weight, bias = _linear_weight(head)
        self.head = self._packed([(weight.to(head_dtype), None if bias is None else bias.to(head_dtype))])

    def _gather(self, layer: torch.nn.Module, config: Any, kind: str) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        routed = self.family.experts and routed_experts(mlp) is not None
        *qkv, o = (_linear_weight(getattr(attn, n)) for n in ATTENTION)
        *gate_up, down = [None] if routed else (_linear_weight(getattr(mlp, n)) for n in MLP)
        # Gemma's post_attention_layernorm norms the attention's output; its pre_feedforward_layernorm is the
        # MLP-input norm that Llama calls post_attention_layernorm
        gemma = self.family.gemma
        mlp_norm = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        heads = self.family.head_norms
        return _Layer(
            input_norm=self._norm_pair(layer.input_layernorm),
            qkv=self._product(qkv),
            q_norm=self._norm_pair(attn.q_norm) if heads else None,
            k_norm=self._norm_pair(attn.k_norm) if heads else None,
            rope=kind if self.rope_by_layer_type else ONE_ROPE,
            # Mistral-style configs name no layer types: their window is the config's, in every layer
            window=None if kind == FULL else getattr(attn, "sliding_window", getattr(config, "sliding_window", None)),
            o=self._product([o]),
            attention_out_norm=self._norm_pair(layer.post_attention_layernorm) if gemma else None,
            mlp_norm=self._norm_pair(mlp_norm),
            gate_up=[] if routed else self._product(gate_up),
            down=[] if routed else self._product([down]),
            experts=self._experts(mlp) if routed else None,
            mlp_out_norm=self._norm_pair(layer.post_feedforward_layernorm) if gemma else None,
        )

    def _norm_pair(self, norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
        """What a norm multiplies by (its weight, or Gemma's (1 + weight) in fp32) and its eps."""
        weight = norm.weight.detach()
        return (1.0 + weight.float() if self.family.gemma else weight), _norm_eps(norm)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension: as the model's norm computes it (Gemma's in fp32, rounded once)."""
        if self.family.gemma:
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

    def _rope(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sign-folded sin at `positions` (R,), each (R, 1, D) in the residual stream's dtype, as the
        model's rotary embedding gives them for layers of RoPE `kind`: rotate_half(x) * sin == cat(x2, x1) *
        cat(-sin1, sin2), one cat of x."""
        by_type = (kind,) if self.rope_by_layer_type else ()
        cos, sin = self.rotary(self.embedding[:1], positions[:, None], *by_type)  # in the hidden states' dtype
        half = cos.shape[-1] // 2
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos.to(self.residual_dtype), signed_sin.to(self.residual_dtype)

    def tabulate_rope(self, positions: int) -> None:
        """Steps gather RoPE's values for positions below `positions` from a table made once (one kernel a step
        instead of about ten), computed by the model's own rotary embedding (ROPE_TYPES: each position's own)."""
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
        return hidden + (out if self.adds_promoted else out.to(self.residual_dtype))

    @contextlib.contextmanager
    def active(self, longest: int) -> Iterator[None]:
        """The block a call's steps run in (ModelStep's interface): RoPE tabulated for `longest` positions, the
        longest sequence the steps reach."""
        self.tabulate_rope(longest)
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
        ropes = {kind: self._rope_at(positions, kind) for kind in self.rope_kinds}
        mlp_out = None
        for index, layer in enumerate(self.layers):
            hidden, mlp_out = self.layer_step(self, hidden, mlp_out, layer, cache.layer(index), *ropes[layer.rope])
        hidden = self._norm(self._residual(hidden, mlp_out), *self.final_norm)
        return self._apply(hidden, self.head).float()

    def _layer(
        self,
        hidden: torch.Tensor,
        mlp_out: torch.Tensor | None,
        layer: _Layer,
        cache: StaticLayerCache | SharedPrefixLayer,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: (the residual stream before it, the previous layer's MLP output or None) -> (the stream after
        its attention, its MLP output). Each layer adds the previous one's MLP output itself, so a compiled layer
        (static_decode's compile) fuses that add with its first norm."""
        if mlp_out is not None:
            hidden = self._residual(hidden, mlp_out)
        out = self._attention(self._norm(hidden, *layer.input_norm), layer, cache, cos, signed_sin)
        if layer.attention_out_norm is not None:
            out = self._norm(out, *layer.attention_out_norm)
        hidden = self._residual(hidden, out)
        out = self._mlp(self._norm(hidden, *layer.mlp_norm), layer)
        return hidden, out if layer.mlp_out_norm is None else self._norm(out, *layer.mlp_out_norm)

    def _attention(
        self,
        x: torch.Tensor,
        layer: _Layer,
        cache: StaticLayerCache | SharedPrefixLayer,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> torch.Tensor:
        """A layer's attention over its cache, from its normed input to its o product's output."""
        rows, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.head_dim
        outs = self._outputs(x, layer.qkv)  # one stacked product, or q, k and v read in place
        qkv = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).view(rows, -1, dim)
        # RoPE's output replaces q and k in place where the products' dtype is the cache's (the static loop's),
        # so the cache takes k and v in one write; else (the engine's fp32 cache under autocast) a buffer does
        rotated = qkv if qkv.dtype == cache.kv_dtype else torch.empty_like(qkv, dtype=cache.kv_dtype)
        if rotated is not qkv:
            rotated[:, heads + kv_heads :] = qkv[:, heads + kv_heads :]
        qk = qkv[:, : heads + kv_heads]  # `qk * cos` below computes in the residual stream's dtype
        if layer.q_norm is not None:
            qk = self._head_normed(qk, layer)
        half = dim // 2
        # rounded once, into the attention's dtype, as the training forward's autocast rounds RoPE's output; the
        # inputs are computed before the output overwrites q and k
        rope_inputs = (qk * cos, torch.cat([qk[..., half:], qk[..., :half]], dim=-1), signed_sin)
        if torch.compiler.is_compiling():  # dynamo refuses a strided `out=`; inductor fuses the copy anyway
            rotated[:, : heads + kv_heads] = torch.addcmul(*rope_inputs)
        else:
            torch.addcmul(*rope_inputs, out=rotated[:, : heads + kv_heads])
        cache.write(rotated[:, heads : heads + 2 * kv_heads, None])  # (R, 2 * kv_heads, 1, D): keys, then values
        attended = cache.attend(rotated[:, :heads, None], self.scaling)  # (R, 1, heads, D)
        return self._apply(attended.reshape(rows, heads * dim), layer.o)

    def _head_normed(self, qk: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """q and k (rows, heads + kv_heads, head_dim) through the layer's per-head norms: Gemma's in fp32, rounded to
        `qk`'s dtype; Qwen3-MoE's in the residual stream's dtype."""
        heads = self.heads
        if self.family.gemma:
            return torch.cat([self._norm(qk[:, :heads], *layer.q_norm), self._norm(qk[:, heads:], *layer.k_norm)], 1)
        qk, dtype, dim = qk.to(self.residual_dtype), self.residual_dtype, self.head_dim
        (q_weight, eps), (k_weight, _) = layer.q_norm, layer.k_norm
        q = F.rms_norm(qk[:, :heads], (dim,), q_weight.to(dtype), eps)
        return torch.cat([q, F.rms_norm(qk[:, heads:], (dim,), k_weight.to(dtype), eps)], dim=1)

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
