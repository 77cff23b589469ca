"""Shared test helpers: tiny random-weight models and transformers' reference output."""

from __future__ import annotations

from typing import Any

import torch

from common.messages import ForwardMode

TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def make_tiny_llama(folder: str, *, model_type: str = "llama", seed: int = 0,
                    **config_overrides: Any) -> str:
    """Save a tiny random model (config.json + model.safetensors, no tokenizer)
    that transformers can load back; returns `folder`.

    Weights are drawn with a wide spread (std 0.3 instead of 0.02) so the
    logits spread out and greedy choices are far from ties: a float32
    reimplementation then matches token for token.
    """
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM), "gemma2": (Gemma2Config, Gemma2ForCausalLM),
               "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM)}
    config_cls, model_cls = classes[model_type]
    # Qwen3's and Gemma's configs default head_dim to 128 or 256 whatever the
    # hidden size: the tiny model's own (hidden / heads) unless a test asks
    # for another
    defaults: dict[str, Any] = {}
    if model_type in ("qwen3", "gemma2", "gemma3_text"):
        defaults["head_dim"] = TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"]
    config = config_cls(**{**TINY_CONFIG, **defaults, **config_overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # norms near 1, but not exactly 1
            else:  # linear weights, biases and the embedding
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


def load_hf(folder: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_last_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits of the last position of one sequence, no cache."""
    return model(torch.tensor([ids])).logits[0, -1].float()


def hf_greedy(folder_or_model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` in float32, exactly `max_new_tokens` tokens.

    EOS is disabled (not suppressed): the model may still pick the EOS id, and
    generation just goes on, as the model process does (stopping is the
    scheduler's job).
    """
    return hf_greedy_with_top(folder_or_model, prompt_ids, max_new_tokens, top=0)[0]


@torch.inference_mode()
def hf_greedy_with_top(folder_or_model: Any, prompt_ids: list[int], max_new_tokens: int,
                       top: int = 5) -> tuple[list[int], list[list[int]]]:
    """hf_greedy plus, at each output position, the ids of the `top` most likely tokens."""
    from transformers import GenerationConfig

    model = load_hf(folder_or_model) if isinstance(folder_or_model, str) else folder_or_model
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                           pad_token_id=0, output_logits=top > 0, return_dict_in_generate=True)
    # generate() fills an unset eos_token_id from the model's own generation
    # config, so that one is cleared for the call too
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(torch.tensor([prompt_ids]), generation_config=gen,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    finally:
        model.generation_config.eos_token_id = saved_eos
    new = out.sequences[0, len(prompt_ids):].tolist()
    assert len(new) == max_new_tokens
    tops = [step[0].float().topk(top).indices.tolist() for step in out.logits] if top > 0 else []
    return new, tops


NEAR_TIE_TOP = 5


def greedy_parting(ours: list[int], ours_top: list[list[int]], ref: list[int],
                   ref_top: list[list[int]]) -> int | None:
    """The criterion serving engines use to compare greedy outputs, since CPU
    matmuls are not batch-invariant (a row alone and in a batch can differ by
    ~1e-6): the sequences must be identical, except that they may part at a
    position where each side's token is among the other's top-5. Returns None
    when identical, the parting position at a near-tie; any other difference
    raises AssertionError. Nothing after a parting is compared: the two runs
    then continue from different prefixes.
    """
    assert len(ours) == len(ref), f"lengths differ: {len(ours)} vs {len(ref)}"
    for pos, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        near_tie = a in ref_top[pos][:NEAR_TIE_TOP] and b in ours_top[pos][:NEAR_TIE_TOP]
        assert near_tie, (f"outputs part at position {pos}: ours {a} (top-5 {ours_top[pos]}), "
                          f"reference {b} (top-5 {ref_top[pos]}): not a near-tie")
        return pos
    return None


class RunnerDriver:
    """Drives a ModelRunner the way the scheduler would, minus the policy:
    hands out request rows and KV slots (scattered, so paging is exercised)
    and builds ForwardBatches with the right prefix/seq lengths."""

    def __init__(self, runner: Any, seed: int = 0) -> None:
        self.runner = runner
        gen = torch.Generator().manual_seed(seed)
        self.free_slots = (torch.randperm(runner.max_total_tokens, generator=gen) + 1).tolist()
        self.free_rows = list(range(1, runner.server_args.max_running_requests + 1))
        self.seq_lens: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        # a window pool (sliding-window models): every full page paired once,
        # in a shuffled order, with the first batch
        self.window_pages: list[int] = []
        if runner.window_pool_tokens:
            page = runner.server_args.page_size
            pages = -(-runner.max_total_tokens // page)
            assert runner.window_pool_tokens >= pages * page, "RunnerDriver pairs every page: a window pool that small"
            shuffled = torch.randperm(pages, generator=gen)
            self.window_pages = torch.stack([torch.arange(pages), shuffled], 1).view(-1).tolist()

    def new_row(self) -> int:
        row = self.free_rows.pop(0)
        self.seq_lens[row] = 0
        self.generated[row] = 0
        return row

    def _slots(self, n: int) -> list[int]:
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        assert len(out) == n, "test KV pool too small"
        return out

    def extend(self, rows: list[int], new_tokens: list[list[int]], decode_rows: int = 0, **sampling: Any) -> Any:
        """Rows continue from whatever they already hold in the pool.
        decode_rows: a mixed step, whose last rows decode one token each."""
        prefix = [self.seq_lens[r] for r in rows]
        for r, toks in zip(rows, new_tokens):
            self.seq_lens[r] += len(toks)
        flat = [t for toks in new_tokens for t in toks]
        mode = ForwardMode.MIXED if decode_rows else ForwardMode.EXTEND
        return self._batch(mode, rows, prefix, flat, decode_rows=decode_rows, **sampling)

    def decode(self, rows: list[int], tokens: list[int], **sampling: Any) -> Any:
        for r in rows:
            self.seq_lens[r] += 1
        return self._batch(ForwardMode.DECODE, rows, [], list(tokens), **sampling)

    def verify(self, rows: list[int], last: list[int], drafts: list[list[int]], **sampling: Any) -> Any:
        """A speculative verify: each row runs its last sampled token and its drafts."""
        batch = self.extend(rows, [[t, *d] for t, d in zip(last, drafts)], **sampling)
        batch.forward_mode = ForwardMode.VERIFY
        return batch

    def step_verify(self, batch: Any) -> list[list[int]]:
        """Run a verify step: each row's kept tokens. A row's pool length falls
        back to what it kept (the rejected drafts' slots are simply not reused)."""
        result = self.runner.forward(batch)
        kept, start = [], 0
        for r, p, s, a in zip(batch.req_pool_indices, batch.prefix_lens, batch.seq_lens, result.accept_lens):
            kept.append(result.next_token_ids[start:start + a])
            start += s - p
            self.seq_lens[r] = p + a
            self.generated[r] += a
        return kept

    def _batch(self, mode: ForwardMode, rows: list[int], prefix: list[int], flat: list[int],
               decode_rows: int = 0, temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1,
               min_p: float = 0.0, seed: int = -1) -> Any:
        from common.messages import ForwardBatch

        n = len(rows)
        batch = ForwardBatch(
            forward_mode=mode, decode_rows=decode_rows, req_pool_indices=list(rows),
            seq_lens=[self.seq_lens[r] for r in rows], prefix_lens=prefix,
            input_ids=flat, out_cache_loc=self._slots(len(flat)),
            temperatures=[temperature] * n, top_ps=[top_p] * n, top_ks=[top_k] * n,
            min_ps=[min_p] * n, seeds=[seed] * n, sample_steps=[self.generated[r] for r in rows],
            window_pages=self.window_pages)
        self.window_pages = []
        return batch

    def step(self, batch: Any) -> list[int]:
        """Run a batch and sample; counts the generated tokens per row."""
        ids = self.runner.forward(batch).next_token_ids
        for r in batch.req_pool_indices:
            self.generated[r] += 1
        return ids

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one ragged batch, then decode them together."""
        rows = [self.new_row() for _ in prompts]
        out = [[t] for t in self.step(self.extend(rows, prompts))]
        for _ in range(max_new_tokens - 1):
            ids = self.step(self.decode(rows, [o[-1] for o in out]))
            for o, t in zip(out, ids):
                o.append(t)
        return out

    def teacher_forced_logits(self, prompt: list[int], answer: list[int]) -> torch.Tensor:
        """Float32 logits [len(answer), vocab] predicting each answer token, the
        way serving computes them: the prompt in one extend, then one decode
        step per answer token, fed the given answer rather than our samples."""
        row = self.new_row()
        out = [self.runner.compute_logits(self.extend([row], [prompt]))[0]]
        for t in answer[:-1]:
            out.append(self.runner.compute_logits(self.decode([row], [t]))[0])
        return torch.stack(out)


def step_inputs(batch: Any, table: torch.Tensor, loc: torch.Tensor) -> Any:
    """A backend's input without a runner: the batch's StepInputs with its new
    tokens at the slots `loc` (which the caller wrote into `table`)."""
    import msgspec

    from model_proc.step_inputs import build_step_inputs

    return build_step_inputs(msgspec.structs.replace(batch, out_cache_loc=loc.tolist()), table)
