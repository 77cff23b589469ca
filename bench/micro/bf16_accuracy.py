"""How far each bfloat16 path's next-token distribution strays from float32's: ours against transformers'.

    python -m bench.micro.bf16_accuracy
    python -m bench.micro.bf16_accuracy [--prompts 64] [--steps 8] [--model-path PATH] [--no-write]

The default model (or `--model-path`), in this process (no server), over a
fixed list of `--prompts` prompts (`PROMPTS`: chat questions through the
model's chat template with its default system prompt, and plain text, some of
them several hundred tokens long). The reference is transformers' float32
forward: its greedy answer of `--steps` tokens per prompt, then one forward
of the prompt and that answer giving the float32 logits at every position.
Each variant computes the logits at the same positions, teacher-forced on
the same tokens:

- transformers bfloat16: one forward, as the reference;
- ours: `ModelRunner` as the model process builds it: the prompt in one
  extend (its every position's logits through the prompt-logprob index), then
  one decode step per answer token, fed the reference's answer. In bfloat16
  with the server's default attention backend (native on a CPU with
  AVX512_BF16 or AMX: the native matmuls, rotary, norms and attention, the
  fused decoder), in bfloat16 with the torch attention backend (the native
  matmuls, torch's SDPA), and in float32; in float32 on a GGUF's own blocks
  (a .gguf --model-path), and on the folder's layer weights rounded at load
  by --quantization int8, int4 and w8a8_int8.

Per variant, over every position (the prompt's, from the extend, and the
answer's, from the decode steps): the mean KL(float32 || variant) of the
next-token distributions, in nats, split by extend and decode positions, the
largest, and the share of positions whose top-1 token is the reference's
(all positions, and the first answer token of each prompt).

Output: its record bench/results/latest/bf16_accuracy.json and bench/RESULTS.md (rendered again);
--no-write: stdout only
"""

from __future__ import annotations

import argparse
import datetime
import enum
import os
import platform
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from bench.lib.run_record import LoadAverage, loadavg, record_run
from common.messages import ForwardBatch, ForwardMode
from common.server_args import ServerArgs, default_model_path
from model_proc.quant import weight as quant_weight
from model_proc.runner import ModelRunner
from model_proc.weights import resolve_model_path

# ---- the prompts ------------------------------------------------------------------------

# Long enough that several hundred positions of a prompt attend over each other.
PASSAGES = [
    "The river begins as snowmelt high in the mountains, a thin thread of cold water that gathers strength "
    "as it descends. By the time it reaches the valley it has absorbed a dozen tributaries, each carrying "
    "silt and stones from its own slopes. Farmers along its banks have depended on its spring floods for "
    "centuries: the water spreads across the fields, leaves a layer of fertile soil, and retreats. In the "
    "last hundred years, dams have tamed the floods, and with them the soil has stopped arriving. The "
    "fields now need fertilizer, and the delta at the river's mouth is slowly sinking into the sea, because "
    "the sand that once rebuilt it each year is trapped behind concrete walls far upstream.",
    "A hash table stores key-value pairs in an array of buckets. To insert a pair, the table computes a "
    "hash of the key, reduces it modulo the number of buckets, and places the pair in that bucket. Two keys "
    "may land in the same bucket; this is a collision, and it is resolved either by chaining, where each "
    "bucket holds a small list, or by open addressing, where the table probes other buckets in a fixed "
    "sequence until it finds an empty one. As the table fills, collisions become more frequent and lookups "
    "slow down, so most implementations grow the array, typically doubling it, once the load factor passes "
    "a threshold such as three quarters. Growing requires rehashing every stored key into the new array.",
    "In the spring of 1869, a small expedition set out to map the canyons of the Colorado River. Its leader "
    "had lost an arm in the Civil War, yet he insisted on climbing the canyon walls himself to take "
    "measurements. The men carried flour, coffee and dried apples in wooden boats that leaked constantly. "
    "Two boats were smashed in the rapids within the first weeks, and much of the food was lost. By late "
    "summer the remaining party was hungry and exhausted, and three men decided to leave the river and walk "
    "out across the desert. They were never seen again. The others, pushing on through the last rapids, "
    "emerged from the canyon two days later and reached a settlement at the mouth of the Virgin River.",
    "To make a simple bread, mix five hundred grams of flour with ten grams of salt and seven grams of dried "
    "yeast. Add three hundred and fifty millilitres of warm water and stir until no dry flour remains. "
    "Knead the dough on a lightly floured surface for about ten minutes, until it is smooth and springs "
    "back when pressed. Place it in an oiled bowl, cover it, and leave it somewhere warm until it has "
    "doubled in size, which takes around an hour. Knock it back, shape it into a loaf, put it in a tin and "
    "let it rise again for thirty minutes. Bake at two hundred and twenty degrees for thirty to thirty-five "
    "minutes, until the crust is golden and the loaf sounds hollow when tapped underneath.",
]

CHAT = [
    "What is the capital of France?",  # the README's question: a near tie at its first answer token
    "What is the capital of Japan?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than twenty.",
    "Who wrote Hamlet?",
    "How do I reverse a list in Python?",
    "What is the difference between weather and climate?",
    "Give me a recipe for pancakes.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "What are the three states of matter?",
    "Suggest a name for a black cat.",
    "How many legs does a spider have?",
    "What does a CPU do?",
    "Write a short poem about autumn leaves.",
    "What is 17 times 23?",
    "Explain what a black hole is to a child.",
    "What is the boiling point of water at sea level?",
    "Name a famous painting by Leonardo da Vinci.",
    "How can I improve my sleep?",
    "What is machine learning?",
    "Tell me a joke about computers.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What causes earthquakes?",
    "Write a SQL query that counts the rows of a table named orders.",
    "What is the largest planet in the solar system?",
    "Give three tips for learning a new language.",
    "What is the Pythagorean theorem?",
    "Describe a sunset in one sentence.",
    "Quelle est la capitale de l'Italie ?",
    "Was ist die Hauptstadt von Deutschland?",
    "Summarize this text in one sentence:\n\n" + PASSAGES[0],
    "What is the main problem described here?\n\n" + PASSAGES[0] + "\n\n" + PASSAGES[2],
    "Explain this to a beginner:\n\n" + PASSAGES[1],
    "Rewrite these instructions as a numbered list:\n\n" + PASSAGES[3],
    "Read the following passages and say which one is about food.\n\n" + "\n\n".join(PASSAGES),
    "Answer the question using the text.\n\n" + PASSAGES[2] + "\n\nQuestion: What did the expedition carry?",
    "What is a good name for a bakery? Give five ideas.",
    "Write a Python function that returns the factorial of n.",
]

PLAIN = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 5, 8, 13, 21,",
    "In 1492, Columbus",
    "The mitochondria is the powerhouse of the cell. It",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\ny =",
    "Dear Sir or Madam,\n\nI am writing to",
    "The three primary colors are",
    "Water is made of hydrogen and",
    "Monday, Tuesday, Wednesday,",
    "Le chat est sur la table. Le chien",
    "The best way to learn programming is",
    "Question: What is 2 + 2?\nAnswer:",
    "The Great Wall of China is",
    "<html>\n<head>\n<title>",
    "Step 1: Preheat the oven to 180 degrees.\nStep 2:",
    PASSAGES[0],
    PASSAGES[1],
    PASSAGES[2] + " " + PASSAGES[0],
    PASSAGES[3],
    " ".join(PASSAGES),
    PASSAGES[1] + "\n\nIn summary,",
]

PROMPTS: list[tuple[str, str]] = [("chat", q) for q in CHAT] + [("plain", t) for t in PLAIN]


def encode_prompts(tokenizer, count: int, which: list[int] | None = None) -> list[list[int]]:
    """The ids of the first `count` prompts, or of those at the indices
    `which` (the chat ones through the model's chat template)."""
    chosen = [PROMPTS[i] for i in which] if which is not None else PROMPTS[:count]
    if count > len(chosen):
        raise ValueError(f"{count} prompts asked for: there are {len(chosen)}")
    out = []
    for kind, text in chosen:
        if kind == "chat":
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        else:
            out.append(tokenizer.encode(text))
    return out


# ---- the variants -------------------------------------------------------------------------


class Variant(enum.Enum):
    HF_BF16 = "transformers bfloat16"
    OURS_BF16 = "ours bfloat16 (default backend)"
    OURS_BF16_TORCH = "ours bfloat16, torch attention"
    OURS_F32 = "ours float32"
    # a GGUF --model-path served on its own blocks (model_proc/quant/): with activations rounded
    # to 8 bits in the products of up to 32 rows (quant.weight.use_q8_activations), and with every
    # product in float32 (the server's default)
    OURS_BLOCKS = "ours float32, the GGUF's blocks, 8-bit activations"
    OURS_BLOCKS_F32 = "ours float32, the GGUF's blocks"
    # a Hugging Face folder's layer weights rounded into blocks at load (--quantization)
    OURS_INT8 = "ours float32, --quantization int8 (Q8_0)"
    OURS_INT4 = "ours float32, --quantization int4 (Q4_1)"
    OURS_W8A8 = "ours float32, --quantization w8a8_int8"


BLOCK_VARIANTS = (Variant.OURS_BLOCKS, Variant.OURS_BLOCKS_F32)  # a GGUF --model-path's only
AT_LOAD = {Variant.OURS_INT8: "int8", Variant.OURS_INT4: "int4", Variant.OURS_W8A8: "w8a8_int8"}
FLOAT32_VARIANTS = (Variant.OURS_F32, *BLOCK_VARIANTS, *AT_LOAD)


def runner_args(variant: Variant, model_path: str, context: int) -> ServerArgs:
    """model_path: the GGUF for a blocks variant, else the Hugging Face folder."""
    dtype = "float32" if variant in FLOAT32_VARIANTS else "bfloat16"
    extra: dict[str, str] = {"attention_backend": "torch"} if variant is Variant.OURS_BF16_TORCH else {}
    if variant in AT_LOAD:
        extra["quantization"] = AT_LOAD[variant]
    return ServerArgs(model_path=model_path, dtype=dtype, max_running_requests=1, context_length=context,
                      max_total_tokens=context, **extra)


def _batch(mode: ForwardMode, seq_len: int, prefix: int, ids: list[int], slots: list[int],
           **extra: object) -> ForwardBatch:
    return ForwardBatch(forward_mode=mode, req_pool_indices=[1], seq_lens=[seq_len],
                        prefix_lens=[] if mode is ForwardMode.DECODE else [prefix], input_ids=ids,
                        out_cache_loc=slots, temperatures=[0.0], top_ps=[1.0], top_ks=[-1], min_ps=[0.0],
                        seeds=[-1], sample_steps=[0], **extra)


@torch.inference_mode()
def runner_logits(runner: ModelRunner, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Float32 logits [len(prompt) + len(answer) - 1, vocab]: every prompt
    position's from one extend, then one decode step per answer token but
    the last, each fed the given answer token."""
    n = len(prompt)
    logprobs = {"input_logprob_rows": [0], "input_logprob_starts": [0], "input_logprob_targets": [prompt[1:]]} \
        if n > 1 else {}
    out = runner.compute_logits(_batch(ForwardMode.EXTEND, n, 0, prompt, list(range(1, n + 1)), **logprobs))
    rows = [out[1:], out[:1]]  # positions 0 .. n-2, then the last (the row's own)
    for i, t in enumerate(answer[:-1]):
        rows.append(runner.compute_logits(_batch(ForwardMode.DECODE, n + i + 1, 0, [t], [n + i + 1])))
    return torch.cat(rows)


@torch.inference_mode()
def blocks_logits(runner: ModelRunner, prompt: list[int], answer: list[int], q8: bool) -> torch.Tensor:
    """runner_logits with the 8-bit activations of quantized products on or off."""
    saved, quant_weight.use_q8_activations = quant_weight.use_q8_activations, q8
    try:
        return runner_logits(runner, prompt, answer)
    finally:
        quant_weight.use_q8_activations = saved


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    answer = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[answer[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        answer.append(int(out.logits[0, -1].argmax()))
    return answer


@torch.inference_mode()
def hf_logits(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt + answer[:-1]])).logits[0].float()


def kl_per_position(ref: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(x)) per row, in nats, in float64."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(x.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


# ---- the measurement ------------------------------------------------------------------------


@dataclass
class Tally:
    """One variant's per-position figures, over every prompt."""
    kl_extend: list[torch.Tensor] = field(default_factory=list)
    kl_decode: list[torch.Tensor] = field(default_factory=list)
    agree: list[torch.Tensor] = field(default_factory=list)
    first_agree: list[bool] = field(default_factory=list)

    def add(self, kl: torch.Tensor, agree: torch.Tensor, prompt_len: int) -> None:
        self.kl_extend.append(kl[:prompt_len])
        self.kl_decode.append(kl[prompt_len:])
        self.agree.append(agree)
        self.first_agree.append(bool(agree[prompt_len - 1]))

    def summary(self) -> dict[str, float]:
        ext, dec = torch.cat(self.kl_extend), torch.cat(self.kl_decode)
        every = torch.cat([ext, dec])
        return {"mean_kl": every.mean().item(), "mean_kl_extend": ext.mean().item(),
                "mean_kl_decode": dec.mean().item() if dec.numel() else 0.0, "max_kl": every.max().item(),
                "top1_agreement": torch.cat(self.agree).double().mean().item(),
                "first_token_agreement": sum(self.first_agree) / len(self.first_agree),
                "positions": every.numel()}


@dataclass
class Measured:
    tallies: dict[Variant, Tally]
    first_tokens: dict[Variant, int]  # each variant's top-1 at the first prompt's first answer token
    first_gap: float                  # the reference's top-two logit gap there
    reference_first: int


def measure(model_path: str, prompts: list[list[int]], steps: int, variants: list[Variant],
            progress: Callable[[str], None] = lambda _: None) -> Measured:
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path(model_path, ServerArgs(model_path=model_path).cache_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    answers, refs = [], []
    for p in prompts:
        answers.append(hf_greedy(ref_model, p, steps))
        refs.append(hf_logits(ref_model, p, answers[-1]))
    del ref_model
    context = max(len(p) for p in prompts) + steps + 1
    # blocks are a GGUF's own: no such variant for a Hugging Face folder
    variants = [v for v in variants if v not in BLOCK_VARIANTS or model_path.endswith(".gguf")]
    tallies = {v: Tally() for v in variants}
    first_tokens = {}
    for v, logits_of in variant_logits(folder, variants, context, model_path):
        for i, (p, a, ref) in enumerate(zip(prompts, answers, refs)):
            x = logits_of(p, a)
            tallies[v].add(kl_per_position(ref, x), x.argmax(-1) == ref.argmax(-1), len(p))
            if i == 0:
                first_tokens[v] = int(x[len(p) - 1].argmax())
        progress(f"  {v.value}: mean KL {tallies[v].summary()['mean_kl']:.2e}")
    top2 = refs[0][len(prompts[0]) - 1].topk(2).values
    return Measured(tallies, first_tokens, (top2[0] - top2[1]).item(), int(refs[0][len(prompts[0]) - 1].argmax()))


def variant_logits(folder: str, variants: list[Variant], context: int, model_path: str = ""
                   ) -> Iterator[tuple[Variant, Callable[[list[int], list[int]], torch.Tensor]]]:
    """Each variant's logits function, one model in memory at a time (a
    blocks variant on `model_path`, a GGUF)."""
    from transformers import AutoModelForCausalLM

    for v in variants:
        if v is Variant.HF_BF16:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
            yield v, lambda p, a, m=model: hf_logits(m, p, a)
        elif v in BLOCK_VARIANTS:
            runner = ModelRunner(runner_args(v, model_path, context))
            yield v, lambda p, a, r=runner, q8=v is Variant.OURS_BLOCKS: blocks_logits(r, p, a, q8)
        elif v in AT_LOAD:
            runner = ModelRunner(runner_args(v, folder, context))
            yield v, lambda p, a, r=runner, q8=v is Variant.OURS_W8A8: blocks_logits(r, p, a, q8)
        else:
            runner = ModelRunner(runner_args(v, folder, context))
            yield v, lambda p, a, r=runner: runner_logits(r, p, a)


# ---- the report -------------------------------------------------------------------------------


def report(command: str, m: Measured, prompts: list[list[int]], steps: int, tokenizer,
           load: tuple[list[float], list[float]]) -> str:
    lens = [len(p) for p in prompts]
    hf = m.tallies.get(Variant.HF_BF16)
    hf_kl = hf.summary()["mean_kl"] if hf else None
    lines = [f"## bfloat16 and quantized weights against float32: ours and transformers', "
             f"{datetime.date.today().isoformat()}", "",
             f"`{command}`", "",
             f"{len(prompts)} prompts ({sum(k == 'chat' for k, _ in PROMPTS[:len(prompts)])} chat, the rest plain "
             f"text; {min(lens)}-{max(lens)} tokens, {sum(lens)} in all), each with the float32 greedy answer of "
             f"{steps} tokens; the reference is transformers' float32 forward. KL(float32 || variant) in nats per "
             f"position, over every prompt position (ours: one extend) and answer position (ours: decode steps, "
             f"teacher-forced). {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads; load average {load[0][0]:.1f} at the start, {load[1][0]:.1f} at "
             f"the end.", "",
             "| variant | mean KL | extend KL | decode KL | max KL | top-1 agreement | first token agreement | "
             "KL / transformers bf16 |", "|---|---|---|---|---|---|---|---|"]
    for v, t in m.tallies.items():
        s = t.summary()
        ratio = f"{s['mean_kl'] / hf_kl:.2f}" if hf_kl else "-"
        lines.append(f"| {v.value} | {s['mean_kl']:.2e} | {s['mean_kl_extend']:.2e} | {s['mean_kl_decode']:.2e} | "
                     f"{s['max_kl']:.2e} | {s['top1_agreement']:.2%} | {s['first_token_agreement']:.2%} | "
                     f"{ratio} |")
    first = ", ".join(f"{v.value} {tokenizer.decode([t])!r}" for v, t in m.first_tokens.items())
    lines += ["", f"The first prompt's first answer token (float32 {tokenizer.decode([m.reference_first])!r}, its "
              f"top two logits {m.first_gap:.3f} apart): {first}."]
    return "\n".join(lines) + "\n"


def model_label(model_path: str) -> str:
    """A record label from a --model-path: its file or folder name, in [A-Za-z0-9_-]."""
    name = os.path.basename(model_path.rstrip("/")).removesuffix(".gguf")
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"the first N of the {len(PROMPTS)} prompts")
    p.add_argument("--steps", type=int, default=8, help="answer tokens per prompt (decode steps: one fewer)")
    p.add_argument("--variants", nargs="+", choices=[v.name.lower() for v in Variant],
                   default=[v.name.lower() for v in Variant])
    p.add_argument("--model-path", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--no-write", action="store_true", help="print only: no record, bench/RESULTS.md left alone")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    model_path = args.model_path or default_model_path()
    folder = resolve_model_path(model_path, ServerArgs(model_path=model_path).cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = encode_prompts(tokenizer, args.prompts)
    variants = [Variant[name.upper()] for name in args.variants]
    load0 = loadavg()
    m = measure(model_path, prompts, args.steps, variants, progress=lambda s: print(s, flush=True))
    command = "python -m bench.micro.bf16_accuracy " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(command.strip(), m, prompts, args.steps, tokenizer, (load0, loadavg()))
    print("\n" + text)
    summaries = {v.name.lower(): t.summary() for v, t in m.tallies.items()}
    if not args.no_write:
        record_run(text, "bench.micro.bf16_accuracy",
                   data=[{"variant": k, **{n: round(x, 8) if isinstance(x, float) else x for n, x in s.items()}}
                         for k, s in summaries.items()],
                   load_average=LoadAverage(load0, loadavg()),
                   # another model's run is a record of its own, beside the default model's
                   label=None if args.model_path is None else model_label(args.model_path))
    return summaries


if __name__ == "__main__":
    main()
