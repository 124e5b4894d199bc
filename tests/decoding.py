"""Checks shared by the decode-step tests: a sampler's greedy tokens against transformers generate's, and its sampled
logprobs against a separate forward's."""

import torch

from grouprl.core.types import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD, EOS = 0, 2  # the test models' padding and end-of-sequence ids


def sharpened(model, factor):
    """Sharper attention and logits: a wrong step changes the tokens."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.mul_(factor)
    return model


def greedy_and_generates(sampler, prompts, new_tokens, **generate_options):
    """(the sampler's greedy tokens, transformers generate's ended after EOS) for `prompts`, left-padded."""
    greedy = sampler.generate(prompts, 1, SamplingParams(max_new_tokens=new_tokens, top_k=1))
    width = max(map(len, prompts))
    want = sampler.model.generate(
        input_ids=torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=DEVICE),
        attention_mask=torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEVICE),
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
        **generate_options,
    )[:, width:].tolist()
    return [c.token_ids for c in greedy], [row[: row.index(EOS) + 1] if EOS in row else row for row in want]


def samples_keep_to_the_forward_without(sampler, prompts, suppressed):
    """Sampled, each token's logprob is a separate forward's with the `suppressed` token removed, which never comes."""
    model = sampler.model
    for sample in sampler.generate(prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0)):
        prompt = prompts[sample.prompt_index]
        assert suppressed not in sample.token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + sample.token_ids], device=DEVICE)).logits[0].float()
        logits = logits[len(prompt) - 1 : -1].index_fill(1, torch.tensor([suppressed], device=DEVICE), -float("inf"))
        expected = logits.log_softmax(-1).gather(1, torch.tensor(sample.token_ids, device=DEVICE)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sample.sampler_logprobs), expected.cpu(), atol=1e-4, rtol=1e-4)
