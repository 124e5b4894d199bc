"""Every text-generation model type of the installed transformers, built tiny: it samples through the captured loop,
or is refused with its reason. The list comes from transformers' own auto mapping (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
not from a hand-kept table, so a new release's models are tried as they arrive.

For each accepted model type: the fp32 log-probabilities of the loop's step equal one full forward's within 1e-5 over
128 positions (2e-5 where some layers are linear attention: the forward's chunked scan and the step's recurrence sum
in different orders, 1.1e-5 measured on OLMo-Hybrid on an AVX512-BF16 CPU), its sliding windows and attention
chunks shrunk to decode_probe.WINDOW tokens, so that they slide; greedy tokens equal those of the model's full
forward without a cache; and the planted errors are caught (the probe's gap passes that tolerance, or the step
refuses): RoPE one position ahead, the norm weights 1% off (where the norms have weights), a sliding window one too
wide (where there are windows). The counts and the lists are printed
(`pytest -s`) and written to $GROUPRL_FAMILY_MATRIX when set.

A tier of its own (`-m family_matrix`, deselected by default; .ci/run runs it against the pinned transformers and the
newest release): ~200 model types take minutes.
"""

import copy
import json
import os

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from grouprl.core.types import SamplingParams
from grouprl.generation import decode_probe
from grouprl.generation.model_step import ModelStep
from grouprl.generation.static_decode import CapturedGenerator, step_choice
from grouprl.model.layer_configs import LINEAR_ATTENTION, layer_kinds

pytestmark = pytest.mark.family_matrix

WIDTHS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64)
RESULTS: dict[str, dict[str, str]] = {"accepted": {}, "refused": {}, "not built tiny": {}}


class Tokens:
    """The loop decodes text for its completions; the matrix reads token ids only."""

    def decode(self, ids, skip_special_tokens=True):
        return ""


def tiny(model_type: str) -> torch.nn.Module:
    """The model type's default config at small widths (where it has them) and decode_probe.shrink's depth,
    vocabulary and windows; random fp32 weights, seeded."""
    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config()
    for name, value in WIDTHS.items():
        if getattr(text, name, None) is not None:
            setattr(text, name, value)
    decode_probe.shrink(text)
    torch.manual_seed(0)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()
    with torch.no_grad():  # larger weights: log-probabilities that depend clearly on position and context
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(3.0)
    with torch.no_grad():  # it runs with transformers' own cache, or it is not a model the loop could sample
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    return model


def planted_errors(model: torch.nn.Module) -> dict[str, object]:
    """Step factories that each compute one thing wrong (module doc)."""

    class AheadStep(ModelStep):
        def _forward(self, tokens, positions, view):
            return ModelStep._forward(self, tokens, positions + 1, view)

    def norms_off(m):
        wrong = copy.deepcopy(m)
        with torch.no_grad():
            for module in wrong.modules():
                if is_norm(module):
                    module.weight.mul_(1.01).add_(0.01)  # a weight of 0 (Gemma's 1 + w) moves too
        return ModelStep(wrong)

    errors = {"RoPE one position ahead": AheadStep}
    if any(is_norm(module) for module in model.modules()):  # OLMo's and nanochat's norms have no weights
        errors["the norm weights 1% off"] = norms_off
    if any(w is not None for w in ModelStep(model).windows):

        class WiderStep(ModelStep):
            def __init__(self, m):
                super().__init__(m)
                self.windows = [None if w is None else w + 1 for w in self.windows]

        errors["a window one too wide"] = WiderStep
    return errors


def is_norm(module: torch.nn.Module) -> bool:
    """A normalisation layer with a weight of its own (RMSNorm, LayerNorm, by any family's name)."""
    weight = getattr(module, "weight", None)
    named = "norm" in type(module).__name__.lower()
    return named and isinstance(weight, torch.nn.Parameter) and weight.ndim == 1


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_the_model_type_samples_through_the_captured_loop_or_is_refused_by_name(model_type):
    try:
        model = tiny(model_type)
    except Exception as err:  # noqa: BLE001 - any failure to build it tiny is that model type's reason
        RESULTS["not built tiny"][model_type] = f"{type(err).__name__}: {str(err)[:160]}"
        pytest.skip(f"{model_type} does not build tiny here: {RESULTS['not built tiny'][model_type]}")
    kind, reason = step_choice(model, "model")
    if reason is not None:
        RESULTS["refused"][model_type] = reason
        assert isinstance(reason, str) and len(reason) > 10  # a refusal names its reason
        return
    RESULTS["accepted"][model_type] = kind
    recurrent = LINEAR_ATTENTION in layer_kinds(model.config.get_text_config())
    tolerance = 2e-5 if recurrent else 1e-5
    assert decode_probe.step_gap(model, ModelStep, positions=128) < tolerance
    for what, make_step in planted_errors(model).items():
        try:
            gap = decode_probe.step_gap(model, make_step, positions=128)
        except NotImplementedError:
            continue  # the step refused to compute it
        assert gap > tolerance, f"{what} went unnoticed (gap {gap:.3g})"
    prompts = [[5, 9, 13, 2, 7, 30], [40, 41], [3, 3, 8, 60]]
    vocab = model.config.get_text_config().vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    sampler = CapturedGenerator(model, Tokens(), [], 0, capture=False, decode_step="model")
    got = [c.token_ids for c in sampler.generate(prompts, 1, SamplingParams(max_new_tokens=12, top_k=1))]
    for prompt, tokens in zip(prompts, got):
        assert tokens == greedy_without_cache(model, prompt, 12)


def greedy_without_cache(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding by the model's full forward over the whole sequence at every step: no cache, no generation
    config (whose EOS, processors and defaults differ by model type), the plainest reference there is."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_the_matrix_counts_are_printed():
    """Runs last (pytest keeps the file's order): the counts and lists of the run above."""
    counts = {what: len(types) for what, types in RESULTS.items()}
    print(f"\nmodel types: {counts}")
    for what, types in RESULTS.items():
        for model_type, why in sorted(types.items()):
            print(f"  {what}: {model_type}: {why}")
    if os.environ.get("GROUPRL_FAMILY_MATRIX"):
        with open(os.environ["GROUPRL_FAMILY_MATRIX"], "w", encoding="utf-8") as out:
            json.dump(RESULTS, out, indent=1, sort_keys=True)
    assert counts["accepted"] >= 1 or not any(counts.values())
