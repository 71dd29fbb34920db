"""The engine: schedule, run, update. No threads, no asyncio, no HTTP."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import setup
from engine.attention import select_backend
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.cpu_weights import prepare_weights
from engine.cuda_graphs import DecodeGraphRunner, graph_buckets, graphs_enabled
from engine.kv_cache import allocate_kv_cache
from engine.loader import load_model
from engine.model_runner import ModelRunner, ModelRunnerOutput
from engine.output_processor import RequestTextState, error_output, make_output
from engine.outputs import EngineStats, FinishReason, RequestOutput, TokenLogprob
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.tokenization import chat_prompt_ids, encode_prompt

log = logging.getLogger("tokenmill.engine")


@dataclass
class GenerationResult:
    """One finished request of Engine.generate()."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_tokens: int = 0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig, AutoTokenizer

        path = Path(config.model)
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {config.model!r} is not a Hugging Face model folder (no config.json)")
        self.config = config
        self.model_name = path.name
        self.hf_config = AutoConfig.from_pretrained(str(path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.device = setup.resolve_device(config.device)
        setup.apply_cpu_threads(config.cpu_threads, self.device)
        self.dtype = setup.resolve_dtype(config.dtype, self.hf_config, self.device)
        self.max_model_len = setup.resolve_max_model_len(config, self.hf_config)
        self.block_size = setup.resolve_block_size(config.block_size, self.device)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.eos_token_ids = setup.eos_token_ids(path, self.hf_config, self.tokenizer)
        model = load_model(path, self.hf_config, self.dtype, self.device, self.max_model_len, config.show_progress)
        self.weights = prepare_weights(model, config, self.device, self.dtype)  # packing, kernels, INT8
        self.packed_weights = self.weights.packed
        backend = select_backend(self.device, config.attention_backend, self.dtype)
        if backend.name == "cpu":  # the C++ kernels are loaded: the layers use theirs too
            model.use_cpu_kernels(norms=self.dtype == torch.bfloat16)
        use_graphs = graphs_enabled(self.device, config.enforce_eager, backend)
        buckets = graph_buckets(config.max_num_seqs)
        spec = setup.kv_spec(self.hf_config, self.block_size, self.dtype)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            cuda_profile = self.device.type == "cuda" and config.kv_cache_memory is None
            peak = self._profile_activations(model, backend, buckets[-1] if use_graphs else 0) if cuda_profile else 0
            num_blocks = spec.num_blocks_for(setup.kv_budget_bytes(config, self.device, peak))
        if num_blocks < 1:
            raise ValueError("kv_cache_memory is too small for one KV block")
        self.block_manager = BlockManager(num_blocks, self.block_size, config.enable_prefix_caching)
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler = Scheduler(sched_cfg, self.block_manager)
        self.sampler = Sampler(config.seed)
        kv = allocate_kv_cache(spec, num_blocks, self.device, backend)
        self.kv_cache_bytes = num_blocks * spec.bytes_per_block
        graphs = self._capture_graphs(model, backend, kv, buckets) if use_graphs else None
        self.runner = ModelRunner(model, kv, backend, self.block_size, self.device, self.sampler, graphs)
        self._text: dict[str, RequestTextState] = {}
        self._stats = EngineStats(kv_blocks_total=num_blocks)
        log.info(
            "engine ready: %s, %s on %s, %d KV blocks x %d tokens (%d tokens, %.2f GiB), attention=%s, "
            "cuda graphs=%s, packed weights=%s, quantization=%s, small-batch kernels: %s",
            self.model_name, str(self.dtype).removeprefix("torch."), self.device, num_blocks,
            self.block_size, num_blocks * self.block_size, self.kv_cache_bytes / 2**30, backend.name,
            ",".join(map(str, buckets)) if graphs else "off", self.packed_weights, self.weights.quantization,
            self.weights.gemv,
        )

    # ---- names the server reads ------------------------------------------------------------------
    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def device_name(self) -> str:
        return str(self.device)

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> int:
        """Queue a request. Returns its prompt length in tokens. Raises ValueError naming the field."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        ids = self._prompt_ids(prompt, prompt_token_ids)
        self._check_fits(len(ids), params.max_tokens)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            priority=priority,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
        )
        self.scheduler.add(req)
        self._text[request_id] = RequestTextState(self.tokenizer, params.stop)
        return len(ids)

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            ids = self.encode(prompt)
            if not ids:
                raise ValueError("prompt must not be empty")
            return ids
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids: {t!r} is not a token id in [0, {self.vocab_size})")
        return ids

    def _check_fits(self, num_prompt: int, max_tokens: int) -> None:
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                f"max_model_len ({self.max_model_len})"
            )
        bs = self.block_manager.block_size
        if -(-(num_prompt + max_tokens) // bs) > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the KV cache "
                f"({self.block_manager.num_blocks * bs} tokens)"
            )

    def abort(self, request_id: str) -> bool:
        """End a request now and free its KV blocks. False when it is unknown or already finished."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, update. Returns this step's outputs (one per request that sampled)."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            result = self.runner.execute(sched)
        except Exception as exc:  # a failed step fails only its own requests
            return self._fail_step(sched, exc)
        outputs = self._update(sched, result)
        self._record_step(sched, time.perf_counter() - t0)
        return outputs

    def _update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        self.scheduler.advance(sched)
        outputs = []
        for s in sched.scheduled:
            req = s.request
            token = result.sampled.get(req.request_id)
            if token is None:
                continue  # a prompt chunk that did not reach the end of the prompt
            out = make_output(req, self._text[req.request_id], token, result.logprobs.get(req.request_id),
                              self.max_model_len)
            if out.finished:
                self._finish(req, out.finish_reason)
            outputs.append(out)
        return outputs

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        log.exception("engine step failed; failing its %d requests", len(sched.scheduled))
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        outputs = []
        for s in sched.scheduled:
            outputs.append(error_output(s.request, message))
            self._finish(s.request, FinishReason.ERROR)
        return outputs

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        self._text.pop(req.request_id, None)
        self.sampler.forget(req.request_id)

    def _record_step(self, sched: SchedulerOutput, elapsed: float) -> None:
        st = self._stats
        decode = sum(1 for s in sched.scheduled if s.num_tokens == 1 and s.start >= s.request.num_prompt_tokens)
        st.steps += 1
        st.last_step_tokens = sched.num_tokens
        st.last_step_decode_tokens = decode
        st.last_step_prefill_tokens = sched.num_tokens - decode
        st.prompt_tokens += sched.num_tokens - decode
        st.generation_tokens += sum(1 for s in sched.scheduled if s.sample)
        st.last_step_time_s = elapsed

    def stats(self) -> EngineStats:
        st = self._stats
        st.running = len(self.scheduler.running)
        st.waiting = len(self.scheduler.waiting)
        st.kv_blocks_used = self.block_manager.num_used_blocks
        st.prefix_cache_queries = self.block_manager.prefix_queries
        st.prefix_cache_hits = self.block_manager.prefix_hits
        st.preemptions = self.scheduler.num_preemptions
        return EngineStats(**vars(st))

    def check_integrity(self) -> None:
        """Block-manager invariants against the live requests (tests; debug)."""
        self.block_manager.check_integrity(self.scheduler.requests.values())

    # ---- offline convenience ------------------------------------------------------------------
    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Run prompts to completion (all submitted at once); results in prompt order.
        Needs an idle engine: it steps until everything is done and would swallow other outputs."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; use add_request/step alongside other work")
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            rid = f"gen-{id(results)}-{i}"
            kwargs = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
            self.add_request(rid, params=p, **kwargs)
            ids = self.scheduler.requests[rid].prompt_token_ids
            results[rid] = GenerationResult(rid, list(ids), [], "", None)
            order.append(rid)
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r.token_ids.extend(out.new_token_ids)
                r.text += out.text_delta
                r.logprobs.extend(out.logprobs or [])
                r.cached_tokens = out.cached_tokens
                if out.finished:
                    r.finish_reason = out.finish_reason
        return [results[rid] for rid in order]

    # ---- device memory ------------------------------------------------------------------------------
    def device_memory(self) -> dict[str, int] | None:
        """Device memory in bytes from CUDA (used and total on the device, allocated by this
        process's PyTorch, the KV cache); None on the CPU."""
        if self.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "used_bytes": int(total - free),
            "total_bytes": int(total),
            "allocated_bytes": int(torch.cuda.memory_allocated(self.device)),
            "kv_cache_bytes": int(self.kv_cache_bytes),
        }

    def _profile_activations(self, model, backend, graph_batch: int = 0) -> int:
        """Bytes to keep free besides the weights, measured, not guessed: the activation peak of one
        forward at the largest step, plus, when decode graphs will be captured (graph_batch > 0),
        that of a decode forward at the largest bucket (the graphs' memory pool stays allocated)."""
        from engine.attention import BatchLayout

        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        bs = self.block_size
        blocks = -(-n // bs)
        prefill = BatchLayout(0, [n], [n], [list(range(blocks))], bs, torch.arange(n))
        peak = self._peak_bytes(model, backend, prefill, blocks, logits_rows=self.config.max_num_seqs)
        if graph_batch:  # one context token each, read from block 0; slot -1 stores nothing
            decode = BatchLayout(graph_batch, [1] * graph_batch, [1] * graph_batch, [[0]] * graph_batch, bs,
                                 torch.full((graph_batch,), -1, dtype=torch.long))
            graph_peak = self._peak_bytes(model, backend, decode, blocks, logits_rows=0)
            log.info("profiled activations: step peak %.0f MiB, decode graphs ~%.0f MiB",
                     peak / 2**20, graph_peak / 2**20)
            peak += graph_peak
        return peak

    def _peak_bytes(self, model, backend, layout, blocks: int, logits_rows: int) -> int:
        from engine.kv_cache import allocate_kv_cache as alloc
        from engine.models.layers import ForwardContext

        n = len(layout.slot_mapping)
        spec = setup.kv_spec(self.hf_config, self.block_size, self.dtype)
        kv = alloc(spec, blocks, self.device, backend)
        pos = [p for c, q in zip(layout.context_lens, layout.query_lens, strict=True) for p in range(c - q, c)]
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            ctx = ForwardContext(backend, backend.build_metadata(layout, self.device), kv)
            hidden = model(ids, positions, ctx)
            if logits_rows:
                model.compute_logits(hidden[-logits_rows:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del kv, ctx, hidden
        torch.cuda.empty_cache()
        return int(peak)

    def _capture_graphs(self, model, backend, kv, buckets) -> DecodeGraphRunner:
        """Capture the decode graphs; logs the memory they took."""
        before = torch.cuda.memory_reserved(self.device)
        graphs = DecodeGraphRunner(
            model, backend, kv, buckets=buckets, block_size=self.block_size,
            max_model_len=self.max_model_len, device=self.device,
        )
        with torch.inference_mode():
            graphs.capture_all()
        torch.cuda.synchronize(self.device)
        log.info("decode graphs hold %.0f MiB", (torch.cuda.memory_reserved(self.device) - before) / 2**20)
        return graphs
