"""GRPO steps on one GPU, TRL 1.16 against grouprl's generation engines, and the decode step alone.

    python3 bench/gpu/bench_generation.py                 # the default plan, inside ~8 minutes on an H100/H200
    python3 bench/gpu/bench_generation.py --tiny --device cpu   # a dry run of the same code with tiny shapes
    python3 bench/gpu/bench_generation.py --cases 1 --only trl,captured   # part of the plan
    MALLOC_MMAP_THRESHOLD_=65536 python3 bench/gpu/bench_generation.py --device cpu --bf16 --as-accelerator \
        --cases 1 --only captured --kinds train   # the GPU case's memory, counted on a CPU (below)

Models are built here with random weights (no hub): the Qwen2.5-0.5B shape (24 layers, hidden 896, 14 / 2
heads, vocabulary 151,936, tied embeddings), the Qwen2.5-1.5B shape (28 layers, hidden 1536, 12 / 2 heads) and
Gemma 3 1B's (26 layers, hidden 1152, 4 / 1 heads of 256, vocabulary 262,144, five 512-token sliding-window layers
to a full one), bf16, with a word-level tokenizer of that vocabulary. Random weights practically never emit the
EOS, so every completion runs to max_completion_length in every library alike.

Per case and library/engine: seconds per optimizer step (the first step not counted), generated tokens per
second, peak GPU memory; per engine the decode step alone (one generation of the case's rows, time / new
tokens); for grouprl the training pass's model FLOPs utilisation (6 x non-embedding parameters x tokens over
the logged forward + backward time, against the card's dense bf16 peak). Prints a table and writes JSON to
$OUT/bench_generation.json (or --out). A run that fails is reported with its error, and the plan stops
starting runs once --budget seconds have passed. Results: docs/benchmarks-gpu.md.

On a CPU the peak is the process's resident memory above what it held when training started (weights, model
copies, libraries): with glibc's MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB every tensor of that size or more is a
mapping of its own, returned when freed, so the peak follows the live tensors as the GPU's allocated bytes do.
`--bf16 --as-accelerator` trains there as the GPU benchmark does (bf16 autocast, shared prompts packed only where
grouprl would pack them on a GPU), so the two libraries' peaks can be compared without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if importlib.util.find_spec("grouprl") is None:  # this checkout's, unless one is installed or on PYTHONPATH
    sys.path.insert(0, os.path.join(ROOT, "src"))

DENSE_BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # FLOP/s, dense (no sparsity)


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    family: str = "qwen2"  # or "gemma3": Gemma 3's layers, head_dim 256, five sliding (512) to a full one; or
    # "qwen3_moe": Qwen3-MoE's layers, head_dim 64 (16 at the tiny shape), 64 experts of `intermediate`, top 8; or
    # "qwen3_5": Qwen3.5's, three linear-attention layers (a gated delta rule, 16 key and 16 value heads of 128) to a
    # gated full-attention one (head_dim 256, RoPE on a quarter of each head); smaller at the tiny shape


SHAPES = {
    "0.5B": Shape("0.5B", 896, 24, 14, 2, 4864, 151_936),
    "1.5B": Shape("1.5B", 1536, 28, 12, 2, 8960, 151_936),
    "gemma3-1B": Shape("gemma3-1B", 1152, 26, 4, 1, 6912, 262_144, "gemma3"),
    "tiny": Shape("tiny", 64, 2, 4, 2, 128, 512),
    "tiny-gemma3": Shape("tiny-gemma3", 64, 6, 4, 1, 128, 512, "gemma3"),
    # Qwen3-MoE's layout at ~1.4B parameters, ~0.35B active: trainable in full on one GPU beside TRL
    "qwen3-moe-1.4B": Shape("qwen3-moe-1.4B", 1024, 24, 16, 4, 256, 151_936, "qwen3_moe"),
    "tiny-qwen3-moe": Shape("tiny-qwen3-moe", 64, 2, 4, 2, 32, 512, "qwen3_moe"),
    # a hybrid of ~0.75B parameters (0.50B outside the embedding), at widths and vocabulary of Qwen3.5's small models
    "qwen3.5-0.8B": Shape("qwen3.5-0.8B", 1024, 24, 8, 2, 3584, 248_320, "qwen3_5"),
    "tiny-qwen3.5": Shape("tiny-qwen3.5", 64, 4, 4, 2, 128, 512, "qwen3_5"),
}


@dataclass(frozen=True)
class Case:
    name: str
    shape: str
    prompts: int
    generations: int
    prompt_tokens: int
    shared_prefix: int  # tokens of one prompt prefix every prompt shares (0: none)
    new_tokens: int
    steps: int
    runs: tuple[str, ...]  # "trl" and grouprl's engines


# captured: the step eager (compile_decode_step=False; left unset it compiles on CUDA), +compile: compiled
# (compile_decode_step=True); continuous_batching: use_transformers_continuous_batching (TRL's
# use_transformers_paged), transformers' generate_batch with its paged cache
ENGINES = ("transformers", "engine", "captured", "captured+compile", "continuous_batching")


def engine_config(engine: str) -> dict:
    """grouprl's GRPOConfig fields for one of ENGINES."""
    if engine == "continuous_batching":
        return {"use_transformers_continuous_batching": True}
    return {"generation_engine": engine.split("+")[0], "compile_decode_step": engine.endswith("+compile")}


PLAN = (
    Case("0.5B, 48-token prompts", "0.5B", 8, 8, 48, 0, 256, 3, ("trl", *ENGINES)),
    Case("0.5B, 1024-token shared prompt + 48", "0.5B", 8, 8, 48, 1024, 256, 3, ("trl", *ENGINES)),
    Case("1.5B, 48-token prompts, 1024 new tokens", "1.5B", 8, 8, 48, 0, 1024, 2, ("trl", "captured")),
    # Gemma 3 (since 2026-11-29 the captured loop's): 1024 new tokens, so its 512-token windows slide
    Case("Gemma 3 1B, 48-token prompts, 1024 new tokens", "gemma3-1B", 8, 8, 48, 0, 1024, 2, ("trl", "captured")),
    # routed experts (since 2026-11-29 the captured loop's, grouped_mm in the graph) against transformers' own
    Case(
        "Qwen3-MoE 1.4B (64 experts, top 8), 48-token prompts",
        "qwen3-moe-1.4B",
        8,
        8,
        48,
        0,
        256,
        2,
        ("trl", "captured"),
    ),
    # linear attention (since 2026-11-29 the captured loop's: its states in place in the graph) against transformers'
    # own decode, whose delta rule runs its PyTorch reference where flash-linear-attention is not installed
    Case("Qwen3.5 0.8B layout, 48-token prompts", "qwen3.5-0.8B", 8, 8, 48, 0, 256, 2, ("trl", "captured")),
)
TINY_PLAN = (
    Case("tiny, 12-token prompts", "tiny", 2, 4, 12, 0, 16, 2, ("trl", *ENGINES)),
    Case("tiny, 40-token shared prompt + 12", "tiny", 2, 4, 12, 40, 16, 2, ("trl", *ENGINES)),
    Case("tiny Gemma 3, 12-token prompts", "tiny-gemma3", 2, 4, 12, 0, 16, 2, ("trl", "transformers", "captured")),
    Case("tiny Qwen3-MoE, 12-token prompts", "tiny-qwen3-moe", 2, 4, 12, 0, 16, 2, ("trl", "transformers", "captured")),
    Case("tiny Qwen3.5, 12-token prompts", "tiny-qwen3.5", 2, 4, 12, 0, 16, 2, ("trl", "transformers", "captured")),
)


def model_config(shape: Shape):
    """The transformers config of a random-weight model of `shape` (its EOS the last id, its pad the one before)."""
    import transformers

    sizes = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=shape.vocab - 1,
        pad_token_id=shape.vocab - 2,
        bos_token_id=None,
    )
    if shape.family == "gemma3":  # Gemma 3 1B's layout (at the tiny shape: a window that slides within 16 tokens)
        window = 512 if shape.hidden > 256 else 8
        layers = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(shape.layers)]
        head_dim = 256 if shape.hidden > 256 else 16
        return transformers.Gemma3TextConfig(
            **sizes, head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window, layer_types=layers
        ), transformers.Gemma3ForCausalLM
    if shape.family == "qwen3_moe":
        experts = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=shape.intermediate)
        return transformers.Qwen3MoeConfig(
            **sizes, **experts, head_dim=64 if shape.hidden > 256 else 16, norm_topk_prob=True
        ), transformers.Qwen3MoeForCausalLM
    if shape.family == "qwen3_5":
        big = shape.hidden > 256
        layers = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(shape.layers)]
        heads, dim = (16, 128) if big else (2, 16)
        linear = dict(linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dim)
        return transformers.Qwen3_5TextConfig(
            **sizes, **linear, linear_value_head_dim=dim, head_dim=256 if big else 16, layer_types=layers
        ), transformers.Qwen3_5ForCausalLM
    return transformers.Qwen2Config(**sizes), transformers.Qwen2ForCausalLM


def build_model(shape: Shape, device: str, dtype: torch.dtype, directory: str) -> str:
    """A random-weight model of `shape` and a word-level tokenizer of its vocabulary, saved to `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    words = {f"w{i}": i for i in range(shape.vocab - 2)}
    words.update({"<pad>": shape.vocab - 2, "<eos>": shape.vocab - 1})
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    config, model_class = model_config(shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config).to(dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = shape.vocab - 1, shape.vocab - 2
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def load_tokenizer(model_dir: str):
    """The word-level tokenizer as saved (AutoTokenizer would pick the model type's own tokenizer class)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    return tokenizer


def prompts_of(case: Case, vocab: int) -> list[str]:
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab - 2, (case.shared_prefix,), generator=generator).tolist()
    rows = []
    for _ in range(case.prompts * 4):  # enough prompts for every step
        own = torch.randint(0, vocab - 2, (case.prompt_tokens,), generator=generator).tolist()
        rows.append(" ".join(f"w{t}" for t in shared + own))
    return rows


def config_kwargs(case: Case, output_dir: str, bf16: bool) -> dict:
    rows = case.prompts * case.generations
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=1,
        num_generations=case.generations,
        max_completion_length=case.new_tokens,
        max_steps=case.steps,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=bf16,
        gradient_checkpointing=True,
        seed=0,
    )


def one_token_reward(completions, **kwargs) -> list[float]:
    return [float(len(str(c))) % 7 for c in completions]


def resident_gb() -> tuple[float, float]:
    """(resident, peak resident) memory of this process, in GB (/proc/self/status: VmRSS, VmHWM)."""
    with open("/proc/self/status") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return tuple(int(fields[name].split()[0]) * 1024 / 1e9 for name in ("VmRSS", "VmHWM"))


def reset_peak_memory(device: str) -> float:
    """Start counting the peak afresh; returns the memory held now (GB) that a CPU's peak is counted above."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return 0.0
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the kernel resets VmHWM to the current VmRSS
    return resident_gb()[0]


def peak_memory_gb(device: str, start: float) -> float:
    """The peak since `reset_peak_memory` (on a CPU above `start`, what it returned), in GB."""
    return torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else resident_gb()[1] - start


def train_run(library: str, engine: str | None, case: Case, model_dir: str, bf16: bool, device: str) -> dict:
    """Train `case.steps` steps; s/step (first step not counted), tokens/s, peak memory (on a CPU above the memory
    held when training started, module doc), the trainer's logs."""
    import datasets

    if library == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grouprl import GRPOConfig, GRPOTrainer
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    extra = engine_config(engine) if library == "grouprl" else {}
    if device == "cpu":
        extra["use_cpu"] = True
    config = GRPOConfig(**config_kwargs(case, f"/tmp/bench-gpu/{library}-{engine}", bf16), **extra)
    dataset = datasets.Dataset.from_dict({"prompt": prompts_of(case, SHAPES[case.shape].vocab)})
    clock = Clock()
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=one_token_reward,
        args=config,
        train_dataset=dataset,
        processing_class=load_tokenizer(model_dir),
        callbacks=[clock],
    )
    memory_at_start = reset_peak_memory(device)
    started = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([started, *clock.ends[:-1]], clock.ends)][1:]
    per_step = sum(steps) / len(steps)
    tokens = case.prompts * case.generations * case.new_tokens
    logs = [e for e in trainer.state.log_history if "loss" in e]
    peak_key = "peak_gpu_memory_gb" if device == "cuda" else "peak_rss_above_start_gb"
    result = {
        "s_per_step": per_step,
        "generated_tokens_per_s": tokens / per_step,
        peak_key: peak_memory_gb(device, memory_at_start),
        "logged_mean_length": logs[-1].get("completions/mean_length") if logs else None,
    }
    if library == "grouprl" and logs:
        phases = {k[len("time/") :]: v for k, v in logs[-1].items() if k.startswith("time/")}
        train_seconds = phases.get("forward", 0.0) + phases.get("backward", 0.0)
        result["phases_s"], result["train_pass_s"] = phases, train_seconds
        result["train_mfu"] = training_mfu(trainer.model, case, train_seconds, device)
    del trainer
    return result


def training_mfu(model: torch.nn.Module, case: Case, seconds: float, device: str) -> float | None:
    peak = next((v for k, v in DENSE_BF16_PEAK.items() if device == "cuda" and k in torch.cuda.get_device_name()), None)
    if not peak or not seconds:
        return None
    parameters = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    tokens = case.prompts * case.generations * (case.shared_prefix + case.prompt_tokens + case.new_tokens)
    return 6 * parameters * tokens / seconds / peak


def decode_run(
    engine: str, case: Case, model_dir: str, dtype: torch.dtype, device: str, decode_step: str | None = None
) -> dict:
    """One generation of the case's rows through `engine` alone (warmed up once): ms per decode step; the warm-up
    call's seconds apart (`first_call_s`: compiles included). `decode_step`: the captured loop's step ('model': the
    model's own forward, 'fused': the hand-written one; None: static_decode.step_choice's)."""
    from transformers import AutoModelForCausalLM

    from grouprl.core.types import SamplingParams
    from grouprl.generation.continuous_batching import ContinuousBatchingGenerator
    from grouprl.generation.engine import FastGenerator
    from grouprl.generation.hf import TransformersGenerator
    from grouprl.generation.static_decode import CapturedGenerator

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tokenizer = load_tokenizer(model_dir)
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    backend_class = {
        "transformers": TransformersGenerator,
        "engine": FastGenerator,
        "captured": CapturedGenerator,
        "continuous_batching": ContinuousBatchingGenerator,
    }
    if engine.startswith("captured"):
        backend = CapturedGenerator(
            model, tokenizer, eos, pad, compile_step=engine == "captured+compile", decode_step=decode_step
        )
    else:
        backend = backend_class[engine](model, tokenizer, eos, pad)
    prompts = [tokenizer(text)["input_ids"] for text in prompts_of(case, SHAPES[case.shape].vocab)[: case.prompts]]
    params = SamplingParams(max_new_tokens=case.new_tokens, temperature=1.0)
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter()
    backend.generate(prompts, case.generations, params)  # warm-up, with the timed call's shapes (compiles, if any)
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    first_call_s = started - first
    completions = backend.generate(prompts, case.generations, params)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    steps = max(len(c.token_ids) for c in completions)
    result = {
        "generation_s": seconds,
        "first_call_s": first_call_s,
        "decode_ms_per_step": 1000 * seconds / steps,
        "new_tokens": steps,
    }
    if engine.startswith("captured"):
        ran, decode_seconds = backend.last_decode
        result["decode_ms_per_step_loop_only"] = 1000 * decode_seconds / max(ran, 1)
        result["kernels_per_decode_step"] = kernels_per_step(backend, prompts, case.generations, params, device)
        result["compile_s"] = backend.report().get("compile_s", 0.0)  # the warm-up's compiling step, timed apart
    del model, backend
    return result


def kernels_per_step(backend, prompts: list[list[int]], generations: int, params, device: str) -> float:
    """GPU kernels one decode step launches (what a replayed graph runs one after another; on a CPU, the aten
    operators called from Python, a dry run): under torch.profiler, the loop run without capture with the timed
    call's shapes (nothing compiles again), less a call with no decode step, over its decode steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from grouprl.core.types import SamplingParams

    def counted(event) -> bool:
        if device == "cuda":
            return event.device_type == DeviceType.CUDA
        parent = event.cpu_parent
        return event.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::"))

    counts = []
    capture, backend.capture = backend.capture, False
    for call in (SamplingParams(max_new_tokens=1, temperature=params.temperature), params):
        with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
            backend.generate(prompts, generations, call)
            if device == "cuda":
                torch.cuda.synchronize()
        counts.append(sum(map(counted, prof.events())))
    backend.capture = capture
    return (counts[1] - counts[0]) / max(backend.last_decode[0], 1)


def environment(device: str) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError as err:
        info["trl"] = f"missing ({err})"
    if device == "cuda":
        info["device"] = torch.cuda.get_device_name()
    else:
        from grouprl.core.cpu_capabilities import summary

        info["device"] = summary()
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run of the script)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds after which no new run starts")
    parser.add_argument(
        "--only",
        default="",
        help="runs to keep, comma-separated: trl and ENGINES (transformers, engine, captured, captured+compile, "
        "continuous_batching)",
    )
    parser.add_argument("--kinds", default="train,decode", help="which measurements: train, decode or both")
    parser.add_argument(
        "--decode-steps",
        default="",
        help="the captured loop's decode runs once with each of these steps, comma-separated: model (its own "
        "forward), fused (the hand-written step); empty: static_decode.step_choice's. A row of fused_step.FAMILIES "
        "keeps the fused step for the captured loop where it is >= 1.25x faster a decode step than the model's",
    )
    parser.add_argument("--cases", default="", help="comma-separated case numbers of the plan to run (1-based; all)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps a training run takes (the case's)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on a CPU too (always on CUDA)")
    parser.add_argument(
        "--as-accelerator",
        action="store_true",
        help="on a CPU, pack shared prompts only where grouprl packs them on a GPU (prompt_packing.worth_packing)",
    )
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_generation.json"))
    args = parser.parse_args()
    if args.steps == 1:
        parser.error("--steps: the first step is not timed, so a run takes at least 2")
    device, bf16 = args.device, args.device == "cuda" or args.bf16
    if args.as_accelerator:
        from grouprl.model import prompt_packing

        prompt_packing.MIN_SAVING = prompt_packing.MIN_SAVING_ACCELERATOR
    dtype = torch.bfloat16 if bf16 else torch.float32
    keep = set(filter(None, args.only.split(",")))
    started, results = time.perf_counter(), {"environment": environment(device), "runs": []}
    print(json.dumps(results["environment"]))
    plan = TINY_PLAN if args.tiny else PLAN
    chosen = [int(n) for n in filter(None, args.cases.split(","))] or range(1, len(plan) + 1)
    for case in (plan[n - 1] for n in chosen):
        case = replace(case, steps=args.steps or case.steps)
        model_dir = build_model(SHAPES[case.shape], device, dtype, f"/tmp/bench-gpu/model-{case.shape}")
        for run in case.runs:
            if keep and run not in keep:
                continue
            for kind in ("train", "decode"):
                if kind not in args.kinds.split(","):
                    continue
                if kind == "decode" and run == "trl":
                    continue  # TRL generates with transformers generate: the "transformers" decode row
                steps = [None]
                if kind == "decode" and run.startswith("captured") and args.decode_steps:
                    steps = args.decode_steps.split(",")
                for step in steps:
                    entry = {"case": case.name, "run": run, "kind": kind, "decode_step": step}
                    if time.perf_counter() - started > args.budget:
                        entry["error"] = "not run: the time budget was spent"
                    else:
                        try:
                            if kind == "train":
                                library, engine = ("trl", None) if run == "trl" else ("grouprl", run)
                                entry.update(train_run(library, engine, case, model_dir, bf16, device))
                            else:
                                entry.update(decode_run(run, case, model_dir, dtype, device, step))
                        except Exception as err:  # noqa: BLE001 - a failed run is a result too
                            entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                        gc.collect()
                        if device == "cuda":
                            torch.cuda.empty_cache()
                    results["runs"].append(entry)
                    print(json.dumps(entry), flush=True)
    results["wall_s"] = time.perf_counter() - started
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=1)
    print_table(results)


def print_table(results: dict) -> None:
    """Per case: s/step and its ratio to TRL's, tokens/s, peak memory, decode ms/step, training MFU."""
    runs = results["runs"]
    for case in dict.fromkeys(r["case"] for r in runs):
        print(f"\n{case}")
        trl = next((r for r in runs if r["case"] == case and r["run"] == "trl" and "s_per_step" in r), None)
        for r in (r for r in runs if r["case"] == case):
            if "error" in r:
                print(f"  {r['run']:19s} {r['kind']:6s} {r['error']}")
            elif r["kind"] == "train":
                ratio = f" ({trl['s_per_step'] / r['s_per_step']:.2f}x TRL)" if trl else ""
                peak = r.get("peak_gpu_memory_gb") or r.get("peak_rss_above_start_gb")
                memory = f", peak {peak:.2f} GB" if peak else ""
                mfu = f", train MFU {r['train_mfu']:.1%}" if r.get("train_mfu") else ""
                print(
                    f"  {r['run']:19s} train  {r['s_per_step']:.2f} s/step{ratio}, "
                    f"{r['generated_tokens_per_s']:.0f} tok/s{memory}{mfu}"
                )
            else:
                kernels = r.get("kernels_per_decode_step")
                kernels = f", {kernels:.0f} kernels/step" if kernels else ""
                seconds = f"{r['decode_ms_per_step']:.2f} ms/step ({r['generation_s']:.2f} s)"
                print(f"  {r['run']:19s} decode {seconds}{kernels}")
    print(f"\nwall {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
