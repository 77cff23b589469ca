"""ModelRunner: turns one ForwardBatch into one sampled token per row.

It owns everything stateful in the model process: weights, KV pool, the
`req_to_token` table, the attention backend and the sampler.

Under tensor parallelism every rank runs one, on the same batches: weights
and KV pool are the rank's shard, everything else (table, sampler, penalty
state) is the same on every rank, and rank 0's sampled tokens are broadcast
so that every rank feeds the same token back.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import time

import torch

from common.cpu_runtime import release_free_memory
from common.messages import FUTURE_TOKEN, ForwardBatch, ForwardMode, ForwardResult, ModelInfo
from common.server_args import QUANTIZED_AT_LOAD, ServerArgs
from model_proc.attention import create_attention_backend, layer_attention
from model_proc.dtypes import dtype_name, resolve_dtype
from model_proc.kv_cache import KVPool, ReqToTokenTable, kv_pool_size, window_pool_size
from model_proc.model import LlamaForCausalLM, ModelConfig
from model_proc.native_decoder import build_native_decoder
from model_proc.parallel import SINGLE, TensorParallel, shard_heads
from model_proc.penalties import PenaltyState
from model_proc.sampler import Sampler, accept_drafts, apply_token_bitmask, logprobs_of_ids, per_token
from model_proc.step_inputs import StepInputBuilder, StepInputs
from model_proc.step_stats import DecodeStepStats
from model_proc.quant import weight as quant_weight
from model_proc.quant import QuantizedWeights
from model_proc.quant.gguf_weights import GGUFWeights
from model_proc.quant.quantize import AT_LOAD_TYPES, QuantizedAtLoad
from model_proc.weights import CheckpointReader, resolve_model_path

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, server_args: ServerArgs, tp: TensorParallel = SINGLE) -> None:
        sa = self.server_args = server_args
        self.tp = tp
        # a tensor-parallel rank runs on its own device (cuda:<local rank>)
        self.device = tp.device if tp.size > 1 else torch.device(sa.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {sa.device}: torch sees no CUDA device on this machine "
                             "(torch.cuda.is_available() is False); use --device cpu")
        self.dtype = resolve_dtype(sa.dtype, self.device)
        self.model_path = resolve_model_path(sa.model_path, sa.cache_dir)
        config = _read_json(os.path.join(self.model_path, "config.json"))
        cfg = self.model_config = ModelConfig.from_dict(config)
        self.context_len = sa.context_length or cfg.max_position_embeddings
        if self.context_len > cfg.max_position_embeddings:
            logger.warning("context length %d exceeds the model's max_position_embeddings %d",
                           self.context_len, cfg.max_position_embeddings)

        # this rank's KV heads (a clear error here if --tp-size does not fit the model)
        kv_heads = shard_heads(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.size).num_kv_heads
        ckpt = CheckpointReader(self.model_path)
        # a GGUF file's matmul weights as its own blocks, or a folder's rounded into blocks (model_proc/quant/)
        quantized: QuantizedWeights | None = None
        if sa.model_path.endswith(".gguf") and sa.quantization != "none":
            quantized = GGUFWeights(sa.model_path, ckpt.names(), cfg.num_heads, cfg.num_kv_heads)
        elif sa.quantization in QUANTIZED_AT_LOAD:
            quantized = QuantizedAtLoad(ckpt, AT_LOAD_TYPES[sa.quantization])
        # what a first start's GGUF conversion freed counts as available for the KV pool
        release_free_memory()
        # sliding layers in a window pool of their own (scheduler_proc/window_pool.py)
        windowed = [w is not None for w in cfg.layer_windows] \
            if cfg.sliding and not sa.disable_hybrid_swa_memory and sa.batching == "continuous" else []
        ratio = sa.swa_full_tokens_ratio if any(windowed) else 0.0
        kv_int8 = sa.kv_cache_dtype == "int8"
        full_bytes, window_bytes = (KVPool.bytes_per_token(n, kv_heads, cfg.head_dim, self.dtype, kv_int8)
                                    for n in (cfg.num_layers - sum(windowed), sum(windowed)))
        bytes_per_token = max(1, full_bytes + int(ratio * window_bytes))
        # this rank's share, roughly (the norms are read by every rank; they are tiny)
        weight_bytes = weight_bytes_of(ckpt, quantized, self.dtype) // tp.size
        # every rank must hold the same slots: the smallest pool any rank affords
        self.max_total_tokens = tp.min_int(kv_pool_size(sa, self.context_len, bytes_per_token, weight_bytes))
        self.sliding_window = max((w for w in cfg.layer_windows if w is not None), default=0)
        self.window_pool_tokens = window_pool_size(sa, self.max_total_tokens, self.sliding_window) \
            if any(windowed) else 0
        self.kv_pool = KVPool(self.max_total_tokens, cfg.num_layers, kv_heads, cfg.head_dim,
                              self.dtype, self.device, windowed=windowed, window_size=self.window_pool_tokens,
                              page_size=sa.page_size, int8=kv_int8)
        self.req_to_token = ReqToTokenTable(sa.max_running_requests, self.context_len, self.device)
        logger.info("KV cache pool: %d tokens, %.1f MiB (%d bytes per token%s); req_to_token %s%s",
                    self.max_total_tokens, self.kv_pool.nbytes / 2**20, bytes_per_token,
                    ", int8 with a scale per token and head" if kv_int8 else "",
                    tuple(self.req_to_token.table.shape),
                    f"; sliding layers' window pool: {self.window_pool_tokens} tokens" if any(windowed) else "")

        self.attn_backend = create_attention_backend(
            sa.attention_backend, self.kv_pool, self.req_to_token, scale=cfg.attn_scale,
            deterministic=sa.deterministic, layers=layer_attention(cfg))
        self.model = LlamaForCausalLM(cfg, self.attn_backend, max_positions=self.context_len,
                                      deterministic=sa.deterministic, tp=tp)
        self.model.to(device=self.device, dtype=self.dtype)
        with ckpt:
            self.model.load_weights(ckpt, quantized)  # this rank's shards; also packs the matmuls
        if quantized is not None:
            source = "the GGUF's blocks" if isinstance(quantized, GGUFWeights) \
                else f"{AT_LOAD_TYPES[sa.quantization].name} blocks rounded at load (--quantization {sa.quantization})"
            logger.info("Weights: %d matmul weights in %s (%.1f MiB), activations %s%s",
                        len(quantized), source, quantized.nbytes / 2**20,
                        "rounded to 8 bits" if quant_weight.use_q8_activations else "in float32", "".join(
                            f"; {name} in {dtype_name(self.dtype)} ({why})"
                            for name, why in quantized.float_types.items()))
            # the model holds what it uses (a fused weight is a copy: q/k/v stacked); the file's
            # separate tensors would double them
            del quantized
        release_free_memory()
        # after the packing: the native decoder holds the packed weights
        self.model.native_decoder = build_native_decoder(self.model)
        self.sampler = Sampler(sa.random_seed, self.device)
        # per req_to_token row, the token it sampled last: a decode input sent
        # as FUTURE_TOKEN (overlap schedule) is taken from here
        self.last_sampled = torch.zeros(self.req_to_token.table.shape[0], dtype=torch.int64,
                                        device=self.device)
        # per req_to_token row: what the penalties of its request need (allocated
        # the first time a request uses them; see model_proc/penalties.py)
        self.penalties = PenaltyState(self.req_to_token.table.shape[0], cfg.vocab_size, self.device)
        # each step's inputs, in buffers sized for a full batch and a prefill chunk
        # (plus the running rows a mixed step adds); grown if a step needs more
        step_tokens = sa.chunked_prefill_size if sa.chunked_prefill_size > 0 else sa.max_prefill_tokens
        self.step_inputs = StepInputBuilder(self.req_to_token.table, self.last_sampled,
                                            rows=self.req_to_token.table.shape[0],
                                            tokens=step_tokens + self.req_to_token.table.shape[0])
        self.step_stats = DecodeStepStats()
        self.model_info = ModelInfo(
            model_path=self.model_path,
            tokenizer_path=sa.tokenizer_path or self.model_path,
            served_model_name=sa.served_model_name or _base_name(sa.model_path),
            context_len=self.context_len,
            max_total_tokens=self.max_total_tokens,
            vocab_size=cfg.vocab_size,
            eos_token_ids=_eos_token_ids(self.model_path, config),
            dtype=dtype_name(self.dtype),
            device=sa.device,
            kv_cache_bytes=self.kv_pool.nbytes,
            cpu_threads=torch.get_num_threads() if self.device.type == "cpu" else 0,
            window_pool_tokens=self.window_pool_tokens,
            sliding_window=self.sliding_window if self.window_pool_tokens else 0,
        )
        if sa.speculative_algorithm and tp.size == 1:  # ranks would all have to run the probes
            self.model_info.step_cost = self.measure_step_cost()
            logger.info("Step cost for speculative decoding: %.2f ms + %.3f ms per token",
                        *(1000 * x for x in self.model_info.step_cost))

    @torch.inference_mode()
    def measure_step_cost(self, sizes: tuple[int, ...] = (1, 4, 16), repeats: int = 4
                          ) -> tuple[float, float]:
        """A step's seconds as fixed + per_token x tokens: verify steps of one
        row of n tokens (every token through the head, as a verify), timed
        before the server takes requests, fitted by least squares over each
        size's fastest run (the other processes are still importing beside
        this one: the fastest is the least disturbed). The probe row is table
        row 0 and its tokens all go to slot 0, the padding dummy, so no
        request's KV is touched."""
        times = []
        for n in sizes:
            batch = ForwardBatch(forward_mode=ForwardMode.VERIFY, req_pool_indices=[0], seq_lens=[n],
                                 prefix_lens=[0], input_ids=[0] * n, out_cache_loc=[0] * n,
                                 temperatures=[0.0], top_ps=[1.0], top_ks=[-1], min_ps=[0.0], seeds=[-1],
                                 sample_steps=[0])
            runs = []
            for _ in range(repeats + 1):  # the first warms up
                start = time.perf_counter()
                inputs = self.step_inputs.build(batch)
                self.req_to_token.table[inputs.token_rows, inputs.positions] = 0
                logits = self._run(inputs)
                self.sampler(logits, inputs.sampling)
                runs.append(time.perf_counter() - start)
            times.append(min(runs[1:]))
        mean_n, mean_t = sum(sizes) / len(sizes), sum(times) / len(times)
        per_token = sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, times)) / \
            sum((n - mean_n) ** 2 for n in sizes)
        per_token = max(per_token, 1e-6)
        return max(mean_t - per_token * mean_n, 1e-6), per_token

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardResult:
        start = time.perf_counter()
        inputs = self.prepare(batch)
        verify = inputs.mode is ForwardMode.VERIFY
        # the rows sampled: one per row, or (VERIFY) one per new token
        n = inputs.num_tokens if verify else inputs.batch_size
        all_logits = self._run(inputs)
        logits, prompt_logits = all_logits[:n], all_logits[n:]
        if batch.penalty_inits:
            self.penalties.init_rows(batch)
        # a verify's penalized rows run one token each (no drafts): a row's
        # logits are its first token's (the penalties work on rows)
        starts = inputs.qo_indptr[:-1] if verify and batch.penalty_rows else None
        if batch.penalty_rows:  # in place; logprobs below are of the penalized logits, as SGLang's
            if starts is None:
                self.penalties.apply(logits, batch, inputs.penalty_rows, inputs.req_pool_indices)
            else:
                row_logits = logits[starts]
                self.penalties.apply(row_logits, batch, inputs.penalty_rows, inputs.req_pool_indices)
                logits[starts] = row_logits
        if batch.grammar_rows:  # after the penalties: a disallowed token stays at -inf
            apply_token_bitmask(logits, batch.grammar_rows, batch.grammar_bitmask)
        assert inputs.sampling is not None
        # every rank samples the same logits alike; rank 0's tokens are
        # broadcast anyway, so no rounding difference can ever part the ranks
        next_ids = self.tp.broadcast_(self.sampler(logits, inputs.sampling))
        result = ForwardResult(next_token_ids=next_ids.tolist())
        if verify:
            result.accept_lens = accept_drafts(batch.input_ids, inputs.extend_lens_host, result.next_token_ids)
            kept = [o + a - 1 for o, a in zip(itertools.accumulate(inputs.extend_lens_host, initial=0),
                                              result.accept_lens)]
            self.last_sampled[inputs.req_pool_indices] = next_ids[kept]
        else:
            self.last_sampled[inputs.req_pool_indices] = next_ids
        if batch.penalty_rows:
            self.penalties.update(batch, next_ids if starts is None else next_ids[starts], inputs.penalty_rows,
                                  inputs.req_pool_indices)
        if not self.tp.is_first:  # only rank 0 answers the scheduler
            return result
        if batch.return_logprob:
            per_row = (batch.top_logprobs_nums, batch.token_ids_logprobs)
            if verify:  # each token's logprobs, as asked for its row
                per_row = tuple(per_token(x, inputs.extend_lens_host) if x else x for x in per_row)
            self._add_logprobs(result, logits, next_ids, *per_row)
        if batch.input_logprob_rows:
            self._add_input_logprobs(result, prompt_logits, batch)
        result.forward_time = time.perf_counter() - start
        self.step_stats.record(inputs.mode, inputs.batch_size, start, result.forward_time)
        return result

    @staticmethod
    def _add_logprobs(result: ForwardResult, logits: torch.Tensor, next_ids: torch.Tensor,
                      top_nums: list[int], token_ids: list[list[int]]) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        result.next_token_logprobs = logprobs.gather(1, next_ids[:, None])[:, 0].tolist()
        if token_ids:
            result.token_ids_logprobs = [logprobs_of_ids(logprobs[i:i + 1], ids)[0] if ids else []
                                         for i, ids in enumerate(token_ids)]
        k = max(top_nums, default=0)
        if k > 0:
            vals, ids = logprobs.topk(k, dim=-1)
            vals_l, ids_l = vals.tolist(), ids.tolist()
            result.top_logprob_vals = [v[:n] for v, n in zip(vals_l, top_nums)]
            result.top_logprob_ids = [i[:n] for i, n in zip(ids_l, top_nums)]

    def _add_input_logprobs(self, result: ForwardResult, logits: torch.Tensor, batch: ForwardBatch) -> None:
        """`logits`: the prompt positions the rows asked for, row after row (the
        model's extra rows). Raw logits: no penalty applies to the prompt."""
        lens = [len(t) for t in batch.input_logprob_targets]
        targets = torch.tensor([t for ts in batch.input_logprob_targets for t in ts], dtype=torch.int64,
                               device=self.device)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        tops = [batch.top_logprobs_nums[r] if batch.top_logprobs_nums else 0 for r in batch.input_logprob_rows]
        k = max(tops, default=0)
        if k > 0:
            vals, ids = logprobs.topk(k, dim=-1)
            vals_l, ids_l = vals.tolist(), ids.tolist()
        start = 0
        for n, top, row in zip(lens, tops, batch.input_logprob_rows):
            if batch.token_ids_logprobs:
                ids = batch.token_ids_logprobs[row]
                result.input_token_ids_logprobs.append(
                    logprobs_of_ids(logprobs[start:start + n], ids) if ids else [])
            result.input_token_logprobs.append(picked[start:start + n])
            if k > 0:
                result.input_top_logprob_vals.append([v[:top] for v in vals_l[start:start + n]] if top else [])
                result.input_top_logprob_ids.append([i[:top] for i in ids_l[start:start + n]] if top else [])
            start += n

    @torch.inference_mode()
    def compute_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Store the step's slots, run the model: float32 logits [B, vocab] of
        each row's last token, then those of the prompt positions asked for
        (input_logprob_rows)."""
        return self._run(self.prepare(batch))

    def prepare(self, batch: ForwardBatch) -> StepInputs:
        """The step's inputs, built once (model_proc/step_inputs.py), with its
        slots written into req_to_token: the scheduler decides every slot, this
        table follows (after the rows the scheduler rewrote, table_rows, took
        their new prefixes). The KV rows the batch copies are copied first."""
        self.check_batch(batch)
        if batch.window_pages:  # before the copies: a copy's destination may be a page paired now
            self.kv_pool.pair_pages(batch.window_pages)
        if batch.kv_copy_src:  # before the step writes anything: a copy's source may be reused by it
            self.kv_pool.copy_slots(torch.tensor(batch.kv_copy_src, dtype=torch.int64, device=self.device),
                                    torch.tensor(batch.kv_copy_dst, dtype=torch.int64, device=self.device))
        inputs = self.step_inputs.build(batch)
        if inputs.table_rewrite is not None:
            self._rewrite_rows(*inputs.table_rewrite)
        self.req_to_token.table[inputs.token_rows, inputs.positions] = inputs.out_cache_loc.to(torch.int32)
        return inputs

    def _run(self, inputs: StepInputs) -> torch.Tensor:
        meta = self.attn_backend.init_forward_metadata(inputs)
        return self.model(inputs.input_ids, inputs.positions, meta, inputs.input_logprob_index,
                          every_token=inputs.mode is ForwardMode.VERIFY)

    def _rewrite_rows(self, rows: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], :lens[i]] = the next lens[i] of the flat slots."""
        dev = self.device
        n = slots.numel()
        row_of = torch.repeat_interleave(torch.arange(rows.numel(), device=dev), lens, output_size=n)
        first = torch.cumsum(lens, 0) - lens
        positions = torch.arange(n, device=dev) - first[row_of]
        self.req_to_token.table[rows[row_of], positions] = slots.to(torch.int32)

    def check_batch(self, b: ForwardBatch) -> None:
        """O(batch) sanity checks: a malformed batch is a scheduler bug, and
        failing loudly beats writing KV into the wrong slots."""
        bs = len(b.req_pool_indices)
        per_row = (b.seq_lens, b.temperatures, b.top_ps, b.top_ks, b.min_ps, b.seeds, b.sample_steps)
        if bs == 0 or any(len(x) != bs for x in per_row):
            raise ValueError(f"ForwardBatch: inconsistent row count {bs} vs {[len(x) for x in per_row]}")
        try:
            mode = ForwardMode(b.forward_mode)
        except ValueError:
            raise ValueError(f"ForwardBatch: unknown forward_mode {b.forward_mode!r}") from None
        if mode.is_decode():
            num_new = bs
        else:
            if len(b.prefix_lens) != bs or any(not 0 <= p < s for p, s in zip(b.prefix_lens, b.seq_lens)):
                raise ValueError("ForwardBatch: extend needs 0 <= prefix_len < seq_len per row")
            num_new = sum(b.seq_lens) - sum(b.prefix_lens)
        if mode.is_mixed() and (not 0 < b.decode_rows <= bs or any(
                s - p != 1 for s, p in zip(b.seq_lens[bs - b.decode_rows:], b.prefix_lens[bs - b.decode_rows:]))):
            raise ValueError("ForwardBatch: a mixed step needs 0 < decode_rows <= rows, each of one new token")
        if not mode.is_mixed() and b.decode_rows:
            raise ValueError("ForwardBatch: decode_rows outside a mixed step")
        if mode is ForwardMode.VERIFY and (b.penalty_inits or b.input_logprob_rows or any(
                b.seq_lens[i] - b.prefix_lens[i] != 1 for i in b.penalty_rows if 0 <= i < bs)):
            # penalty state advances one token at a time: a penalized row verifies no drafts
            raise ValueError("ForwardBatch: a verify step carries no penalty inits, prompt logprobs, or "
                             "drafts of a penalized row")
        if len(b.input_ids) != num_new or len(b.out_cache_loc) != num_new:
            raise ValueError(f"ForwardBatch: {num_new} new tokens but {len(b.input_ids)} input_ids, "
                             f"{len(b.out_cache_loc)} out_cache_loc")
        if min(b.seq_lens) < 1 or max(b.seq_lens) > self.context_len:
            raise ValueError(f"ForwardBatch: seq_lens outside 1..{self.context_len}")
        if min(b.req_pool_indices) < 1 or max(b.req_pool_indices) >= self.req_to_token.table.shape[0]:
            raise ValueError("ForwardBatch: req_pool_indices outside the table")
        if min(b.out_cache_loc) < 0 or max(b.out_cache_loc) > self.max_total_tokens:
            raise ValueError(f"ForwardBatch: out_cache_loc outside 0..{self.max_total_tokens}")
        if b.table_rows and (len(b.table_lens) != len(b.table_rows) or sum(b.table_lens) != len(b.table_slots)
                             or min(b.table_rows) < 1 or max(b.table_rows) >= self.req_to_token.table.shape[0]
                             or min(b.table_lens) < 1 or max(b.table_lens) > self.context_len
                             or min(b.table_slots) < 1 or max(b.table_slots) > self.max_total_tokens):
            raise ValueError("ForwardBatch: table_rows/table_lens/table_slots are inconsistent")
        if b.kv_copy_src and (len(b.kv_copy_src) != len(b.kv_copy_dst)
                              or min(b.kv_copy_src + b.kv_copy_dst) < 1
                              or max(b.kv_copy_src + b.kv_copy_dst) > self.max_total_tokens
                              or len(set(b.kv_copy_dst)) != len(b.kv_copy_dst)
                              or not set(b.kv_copy_dst).isdisjoint(b.kv_copy_src)):
            raise ValueError("ForwardBatch: kv_copy_src/kv_copy_dst are inconsistent")
        if b.window_pages and (self.kv_pool.window_slot is None or len(b.window_pages) % 2
                               or min(b.window_pages) < 0
                               or max(b.window_pages[::2]) >= self.max_total_tokens // self.kv_pool.page_size
                               or max(b.window_pages[1::2]) >= self.window_pool_tokens // self.kv_pool.page_size):
            raise ValueError("ForwardBatch: window_pages are not (full page, window page) pairs of the pools")
        if min(b.input_ids) < FUTURE_TOKEN or max(b.input_ids) >= self.model_config.vocab_size:
            raise ValueError("ForwardBatch: input_ids outside the vocabulary")
        if mode.is_extend() and FUTURE_TOKEN in b.input_ids[:num_new - b.decode_rows]:
            # the token sampled last stands only for a decoding row's one new token
            raise ValueError("ForwardBatch: FUTURE_TOKEN in an extend row (only a decoding row may have it)")
        if b.penalty_rows or b.penalty_inits:
            self._check_penalties(b, bs)
        if b.input_logprob_rows:
            self._check_input_logprobs(b, bs)
        if b.token_ids_logprobs and (len(b.token_ids_logprobs) != bs or any(
                not 0 <= t < self.model_config.vocab_size for ids in b.token_ids_logprobs for t in ids)):
            raise ValueError("ForwardBatch: token_ids_logprobs needs one list per row, of ids in the vocabulary")
        if b.grammar_rows:  # rows sampled: VERIFY samples every new token
            words = (self.model_config.vocab_size + 31) // 32
            sampled = num_new if mode is ForwardMode.VERIFY else bs
            if len(set(b.grammar_rows)) != len(b.grammar_rows) or min(b.grammar_rows) < 0 \
                    or max(b.grammar_rows) >= sampled or len(b.grammar_bitmask) != 4 * words * len(b.grammar_rows):
                raise ValueError("ForwardBatch: grammar_rows/grammar_bitmask are inconsistent")

    def _check_input_logprobs(self, b: ForwardBatch, bs: int) -> None:
        vocab = self.model_config.vocab_size
        if not ForwardMode(b.forward_mode).is_extend() or len(b.input_logprob_starts) != len(b.input_logprob_rows) \
                or len(b.input_logprob_targets) != len(b.input_logprob_rows) \
                or len(set(b.input_logprob_rows)) != len(b.input_logprob_rows):
            raise ValueError("ForwardBatch: input_logprob_rows/starts/targets are inconsistent")
        for r, st, ts in zip(b.input_logprob_rows, b.input_logprob_starts, b.input_logprob_targets):
            if not 0 <= r < bs or st < 0 or st + len(ts) > b.seq_lens[r] - b.prefix_lens[r] \
                    or any(not 0 <= t < vocab for t in ts):
                raise ValueError("ForwardBatch: an input logprob entry is out of range")

    def _check_penalties(self, b: ForwardBatch, bs: int) -> None:
        vocab = self.model_config.vocab_size
        if len(set(b.penalty_rows)) != len(b.penalty_rows) or any(not 0 <= i < bs for i in b.penalty_rows):
            raise ValueError("ForwardBatch: penalty_rows must be distinct positions in the batch")
        if b.penalty_rows and not (b.penalty_inits or self.penalties.allocated):
            raise ValueError("ForwardBatch: penalty_rows for rows whose penalty state was never built")
        for init in b.penalty_inits:
            ids = init.output_ids + init.prompt_ids + list(init.logit_bias)
            if not 0 <= init.row < bs or (ids and (min(ids) < 0 or max(ids) >= vocab)) \
                    or init.min_new_tokens < 0 or init.repetition_penalty <= 0:
                raise ValueError("ForwardBatch: a penalty_inits entry is out of range")


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _base_name(model_path: str) -> str:
    """SmolLM2-135M-Instruct.Q4_1 for a .gguf file; a folder's name as it is
    (a dot in `Qwen2.5-0.5B` is not an extension)."""
    name = os.path.basename(os.path.normpath(model_path))
    return os.path.splitext(name)[0] if os.path.isfile(model_path) else name


def _eos_token_ids(folder: str, config: dict) -> list[int]:
    """eos_token_id of config.json and generation_config.json (each an int or a
    list), deduplicated in first-seen order."""
    found: list[int] = []
    sources = [config]
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        sources.append(_read_json(gen_path))
    for src in sources:
        eos = src.get("eos_token_id")
        for tok in eos if isinstance(eos, list) else [eos]:
            if isinstance(tok, int) and tok not in found:
                found.append(tok)
    return found


def weight_bytes_of(ckpt: CheckpointReader, quantized: QuantizedWeights | None, dtype: torch.dtype) -> int:
    """Bytes the weights take in memory, roughly (the KV pool gets what is left):
    quantized blocks as they are, every other tensor in `dtype`."""
    dense = [name for name in ckpt.names() if quantized is None or quantized.get(name) is None]
    return sum(math.prod(ckpt.shape(name)) for name in dense) * dtype.itemsize \
        + (quantized.nbytes if quantized is not None else 0)
