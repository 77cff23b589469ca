"""The peer most people would reach for first: Hugging Face `generate` on padded batches.

Requests arrive on the trace's clock (offsets from the start); whenever the
model is free, up to `batch_size` arrived requests are left-padded into one
batch and generated together until the longest asks for no more, exactly the
static batching the chapter describes: every row is computed every step, and
a row's extra tokens past its own length are thrown away. `min_new_tokens`
equal to `max_new_tokens` keeps EOS from ending the batch early (ignore_eos).

Timing: a stopping criterion that never stops records when each step's token
exists, so TTFT, ITL and latency are measured as if each row were streamed and
returned the step it reached its own length (a plain `generate` call returns
all rows only when the batch ends). It runs in this process: no HTTP.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from bench.lib.datasets import DatasetRow
from bench.lib.metrics import RequestResult, summarize
from bench.lib.utilisation import batch_utilisation


class StepClock:
    """A StoppingCriteria that never stops: it timestamps every generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFStaticBatcher:
    def __init__(self, model_dir: str, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.tok.padding_side = "left"  # decoder-only: pad before the prompt
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                          dtype=getattr(torch, dtype))
        self.model.eval()

    def generate(self, prompts: list[str], max_new: int) -> tuple[torch.Tensor, list[int], list[float]]:
        """(new token ids [B, max_new], prompt lengths, time of each step's token)."""
        from transformers import GenerationConfig, StoppingCriteriaList

        enc = self.tok(prompts, return_tensors="pt", padding=True)
        clock = StepClock()
        cfg = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                               pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
        with torch.inference_mode():
            out = self.model.generate(**enc, generation_config=cfg,
                                      stopping_criteria=StoppingCriteriaList([clock]))
        prompt_lens = enc["attention_mask"].sum(dim=1).tolist()
        return out[:, enc["input_ids"].shape[1]:], prompt_lens, clock.times

    def run_trace(self, rows: Sequence[DatasetRow], offsets: Sequence[float], batch_size: int
                  ) -> dict[str, Any]:
        """Serve the trace; the same keys as bench_serving's run_benchmark."""
        # Warm-up, as the servers get, at full batch: torch's first call at a new
        # shape (padding mask included) is much slower than the rest.
        self.generate([_text(rows[0])] * min(batch_size, len(rows)), 2)
        results = [RequestResult(client_prompt_len=r.prompt_len, expected_output_len=r.output_len) for r in rows]
        start = time.perf_counter()
        arrival = [start + o for o in offsets]
        batches: list[list[int]] = []
        nxt = 0  # first request not yet batched
        while nxt < len(rows):
            wait = arrival[nxt] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)  # idle until the next request arrives
            now = time.perf_counter()
            batch = [i for i in range(nxt, min(nxt + batch_size, len(rows))) if arrival[i] <= now]
            nxt += len(batch)
            batches.append([rows[i].output_len for i in batch])
            new_ids, prompt_lens, times = self.generate([_text(rows[i]) for i in batch],
                                                        max(rows[i].output_len for i in batch))
            for j, i in enumerate(batch):
                n = rows[i].output_len
                r = results[i]
                r.start = arrival[i]
                r.ttft = times[0] - arrival[i]
                r.itl = [b - a for a, b in zip(times[:n - 1], times[1:n])]
                r.latency = times[n - 1] - arrival[i]
                r.prompt_len, r.output_len = int(prompt_lens[j]), n
                r.generated_text = self.tok.decode(new_ids[j, :n], skip_special_tokens=True)
                r.retokenized_output_len = len(self.tok.encode(r.generated_text, add_special_tokens=False))
                r.success = True
        duration = max(r.start + r.latency for r in results) - start
        out = summarize(results, duration)
        out.update({
            "batch_utilisation": batch_utilisation(batches),
            "batches": batches,
            "output_lens": [r.output_len for r in results],
            "send_times": [r.start - start for r in results],
            "ttfts": [r.ttft for r in results],
            "latencies": [r.latency for r in results],
            "itls": [r.itl for r in results],
            "errors": ["" for _ in results],
        })
        return out


def _text(row: DatasetRow) -> str:
    if not isinstance(row.prompt, str):
        raise ValueError("the HF static peer takes text prompts (use a text dataset)")
    return row.prompt
