"""Token-exact multi-turn rollouts over any `GenerationBackend` (TRL §5's tool loop).

    first turn: the backend samples each rollout's completion of its prompt
    while some rollouts' last turn calls tools (and fewer than max_tool_calling_iterations rounds):
        run the calls (tools.py) -> tool messages -> suffix tokens from the chat template (chat.py)
        roll back rollouts with no room left: the results would leave no token of max_completion_length
        the backend samples one continuation per remaining rollout, prompted with
            prompt ids + every token so far + suffix ids
        cut it to the rollout's remaining budget; parse it for further calls (parsing.py)

Vision-language models: each turn is sampled with the rollout's images, the prompt's and those tool results
returned (content blocks ``{"type": "image", "image": ...}``, rendered by the processor: chat.py), in the order the
sequence shows them; the rollout's `Completion.images` carries them all to training.

A rollout's completion is the concatenation of its model turns and suffixes, never re-tokenised:
`token_ids` are exactly what the model sampled plus what the template inserted, and `tool_mask`
says which is which (True = sampled, trained on; False = tool results and template glue, which
stay in the attention context but are excluded from the loss, KL, entropy, IS statistics and
token counts). The whole completion, suffixes included, stays within max_completion_length.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from grouprl.agents.chat import tool_suffix_ids, tool_suffix_with_images
from grouprl.agents.parsing import parse_turn
from grouprl.agents.tools import Tool, execute_tool_calls
from grouprl.core.types import Completion, SamplingParams
from grouprl.data.multimodal_prompts import message_images
from grouprl.generation.protocol import GenerationBackend, sample_groups
from grouprl.model.multimodal import PromptImages, continuation_inputs, with_tool_images


@dataclass
class TurnSettings:
    tokenizer: Any
    stop_ids: set[int]  # end-of-turn tokens (EOS ids of the tokenizer and generation config)
    max_completion_length: int  # budget of the whole multi-turn completion, tool suffixes included
    max_tool_calling_iterations: Optional[int]  # None = until no rollout calls a tool (or the budget is spent)
    chat_template_kwargs: dict = field(default_factory=dict)
    tool_chat_template: Optional[str] = None  # renders tool results (chat.py); None: the tokenizer's own template
    processor: Any = None  # a vision-language model's processor: renders tool results with images; None: text only


@dataclass
class Transcript:
    """One rollout being built: its prompt, then model turns and tool-result suffixes, as tokens."""

    prompt_ids: list[int]
    toolbox: dict[str, Tool]  # name -> tool this rollout may call
    schemas: Optional[list[dict]]  # the tools' schemas, as rendered into the prompt (for response_template parsers)
    images: Optional[PromptImages] = None  # the prompt's processed images, then the tool results' (None: none yet)
    token_ids: list[int] = field(default_factory=list)
    # the completion with each tool image as the template's placeholder, not its image tokens (for engines that
    # expand placeholders themselves: vLLM)
    placeholder_ids: list[int] = field(default_factory=list)
    tool_mask: list[bool] = field(default_factory=list)
    logprobs: Optional[list[float]] = field(default_factory=list)  # None once a turn came without sampler logprobs
    messages: list[dict] = field(default_factory=list)
    finish_reason: str = "length"
    tool_calls: int = 0
    tool_failures: int = 0

    @property
    def pending_calls(self) -> list[dict]:
        """Tool calls of the last model turn, if the rollout stopped there to wait for their results."""
        last = self.messages[-1] if self.messages else {}
        return (last.get("tool_calls") or []) if last.get("role") == "assistant" else []

    def add_model_turn(self, completion: Completion, settings: TurnSettings) -> None:
        ids = list(completion.token_ids)
        self.messages.append(parse_turn(settings.tokenizer, ids, self.prompt_ids + self.token_ids, self.schemas))
        self.token_ids += ids
        self.placeholder_ids += ids
        self.tool_mask += [True] * len(ids)
        if self.logprobs is not None and completion.sampler_logprobs is not None:
            self.logprobs += list(completion.sampler_logprobs)
        else:
            self.logprobs = None
        self.finish_reason = completion.finish_reason

    def add_tool_turn(
        self,
        tool_messages: list[dict],
        suffix: list[int],
        images: Optional[PromptImages] = None,
        placeholder_suffix: Optional[list[int]] = None,
    ) -> None:
        """The tools' results as `suffix` tokens; with images, `images` are their processor outputs and
        `placeholder_suffix` the suffix with each image as its placeholder (chat.tool_suffix_with_images)."""
        self.messages += tool_messages
        if images is not None:
            self.images = with_tool_images(self.images, self.prompt_ids, len(self.token_ids), images)
        self.placeholder_ids += suffix if placeholder_suffix is None else placeholder_suffix
        self.token_ids += suffix
        self.tool_mask += [False] * len(suffix)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(suffix)  # never used: these positions are outside the loss mask

    def continuation_images(self) -> Optional[PromptImages]:
        """The image inputs of the next turn's prompt (this prompt + the completion so far); None without images."""
        if self.images is None:
            return None
        return continuation_inputs(self.images, len(self.token_ids), self.placeholder_ids)

    def completion(self, prompt_index: int, tokenizer: Any) -> Completion:
        return Completion(
            prompt_index=prompt_index,
            token_ids=self.token_ids,
            text=tokenizer.decode(self.token_ids, skip_special_tokens=True),
            finish_reason=self.finish_reason,
            sampler_logprobs=self.logprobs,
            tool_mask=self.tool_mask,
            prompt_ids=self.prompt_ids,
            messages=self.messages,
            tool_calls=self.tool_calls,
            tool_failures=self.tool_failures,
            images=self.images,
        )


def generate_rows(
    backend: GenerationBackend,
    row_prompts: list[list[int]],
    params: SamplingParams,
    row_images: Optional[list[Optional[PromptImages]]] = None,
) -> list[Completion]:
    """One completion per row; rows with the same prompt (and the same images object) are sampled together (n =
    their count), sharing the prefill. `row_images`: each row's image inputs or None; None: no row has images."""
    images = row_images if row_images is not None and any(m is not None for m in row_images) else None
    rows_of: dict[tuple, list[int]] = defaultdict(list)
    for row, prompt in enumerate(row_prompts):
        rows_of[(tuple(prompt), id(images[row]) if images else None)].append(row)
    unique = list(rows_of)
    out: list[Optional[Completion]] = [None] * len(row_prompts)
    per_prompt = sample_groups(
        backend,
        [list(prompt) for prompt, _ in unique],
        [len(rows_of[key]) for key in unique],
        params,
        None if images is None else [images[rows_of[key][0]] for key in unique],
    )
    for key, completions in zip(unique, per_prompt):
        for row, completion in zip(rows_of[key], completions):
            out[row] = completion
    return out  # type: ignore[return-value]


def continue_with_tools(
    backend: GenerationBackend, transcripts: list[Transcript], params: SamplingParams, settings: TurnSettings
) -> None:
    """Run tool rounds on rollouts whose first turn is in, until none calls a tool or a limit is reached."""
    active = [t for t in transcripts if t.pending_calls]
    rounds = 0
    while active and (settings.max_tool_calling_iterations is None or rounds < settings.max_tool_calling_iterations):
        rounds += 1
        results = execute_tool_calls([t.pending_calls for t in active], [t.toolbox for t in active])
        continuing = []
        for transcript, turn_results in zip(active, results):
            transcript.tool_calls += len(turn_results)
            transcript.tool_failures += sum(r.failed for r in turn_results)
            tool_messages = [r.message() for r in turn_results]
            images, placeholders = None, None
            render = dict(
                stop_ids=settings.stop_ids,
                chat_template_kwargs=settings.chat_template_kwargs,
                chat_template=settings.tool_chat_template,
            )
            if message_images(tool_messages):
                check_image_results(turn_results, settings)
                suffix, images, placeholders = tool_suffix_with_images(settings.processor, tool_messages, **render)
            else:
                suffix = tool_suffix_ids(settings.tokenizer, tool_messages, **render)
            if len(transcript.token_ids) + len(suffix) >= settings.max_completion_length:
                continue  # rolled back: the rollout ends with its calls (they ran and count), without their results
            transcript.add_tool_turn(tool_messages, suffix, images, placeholders)
            continuing.append(transcript)
        if not continuing:
            break
        room = [settings.max_completion_length - len(t.token_ids) for t in continuing]
        completions = generate_rows(
            backend,
            [t.prompt_ids + t.token_ids for t in continuing],
            replace(params, max_new_tokens=max(room)),
            [t.continuation_images() for t in continuing],
        )
        for transcript, completion, budget in zip(continuing, completions, room):
            transcript.add_model_turn(cut_to(completion, budget), settings)
        active = [t for t in continuing if t.pending_calls]


def check_image_results(results: list[Any], settings: TurnSettings) -> None:
    """Images in tool results need a vision-language model's processor, and each image block its image."""
    for result in results:
        blocks = result.content if isinstance(result.content, list) else []
        if any(isinstance(b, dict) and b.get("type") == "image" and b.get("image") is None for b in blocks):
            raise ValueError(
                f"Tool {result.name!r} returned an image block without its image; return "
                "{'type': 'image', 'image': <PIL image or array>} blocks."
            )
        if blocks and settings.processor is None and message_images([result.message()]):
            raise ValueError(
                f"Tool {result.name!r} returned an image, but the model is trained with a tokenizer, not a "
                "vision-language model's processor, so it cannot see images; return text from the tool, or train a "
                "vision-language model (its processor is loaded by default)."
            )


def cut_to(completion: Completion, budget: int) -> Completion:
    """The completion limited to `budget` tokens (finish_reason "length" if it was cut)."""
    if len(completion.token_ids) <= budget:
        return completion
    logprobs = completion.sampler_logprobs[:budget] if completion.sampler_logprobs is not None else None
    return replace(
        completion, token_ids=completion.token_ids[:budget], sampler_logprobs=logprobs, finish_reason="length"
    )
