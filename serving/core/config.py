"""EngineConfig: one engine's settings (model, dtype, KV pages, buckets, parallel degrees, speculation), validated
when built, and the token buckets they imply; SpeculativeConfig, the speculation settings."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pallas_kernels.names import (FLOAT_DTYPES, KV_CACHE_DTYPES, LORA_INT8_RANK_ROWS, WEIGHT_QUANTIZATIONS,
                                  canonical_platform, check_kv_cache_dtype)
from serving.config_flags import option
from serving.params import CHANNEL_REASONING, REASONING_FORMATS

if TYPE_CHECKING:  # JAX-free at import: `serving.server --help` defines its flags from this module
    from serving.core.platform import PlatformChoices

SPECULATIVE_METHODS = ("draft", "ngram")
QUANTIZATIONS = ("none",) + WEIGHT_QUANTIZATIONS


@dataclasses.dataclass(slots=True)
class SpeculativeConfig:
    method: str  # "draft" (a draft model) or "ngram" (prompt lookup)
    num_speculative_tokens: int = 4  # k: drafts per speculating sequence per step
    model: str = ""  # the draft model's directory (method "draft")
    prompt_lookup_min: int = 1  # n-gram lengths tried, longest first (method "ngram")
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 0  # no speculation while this many requests or more are running; 0 = never
    min_acceptance: float = -1.0  # per-request EMA acceptance below which it stops speculating; < 0: break-even

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative_method='draft' needs speculative_model (a directory)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")
        if self.disable_by_batch_size < 0:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 0, got {self.disable_by_batch_size}")
        if self.min_acceptance > 1.0:
            raise ValueError(f"speculative_min_acceptance must be <= 1, got {self.min_acceptance}")



@dataclasses.dataclass(slots=True)
class EngineConfig:
    # A field made with `option` is also the server's flag of that name (serving.config_flags); its help is the flag's.
    model: str = option(help="HF model directory, GGUF file (a split one's part, or a directory holding one), or Orbax "
                        "checkpoint (models.convert).")
    dtype: str = option("float32", "Parameter and activation dtype (and the KV cache's with --kv_cache_dtype=auto).",
                        choices=FLOAT_DTYPES)
    quantization: str = option(
        "none", "Matmul weights quantized at load, per-channel scales (int8 symmetric, fp8 e4m3); 'none': as the "
        "checkpoint holds them (a compressed-tensors or block-wise fp8 checkpoint loads quantized as it is).",
        choices=QUANTIZATIONS)
    kv_cache_dtype: str = option(
        "auto", "KV-cache dtype: 'auto' (--dtype), or quantized with a scale per token and KV head (about twice the "
        "pages of bfloat16 in the same memory).", choices=KV_CACHE_DTYPES)
    page_size: int = option(16, "Tokens per KV page.")
    num_pages: int = option(0, "KV pages; 0: sized from --kv_cache_memory_fraction or --kv_cache_memory_gb.")
    kv_cache_memory_gb: float = option(1.0, "KV-cache size when --num_pages=0.")
    max_model_len: int | None = option(None, "Context cap in tokens; 0: the model's.", none_as=0)
    max_num_seqs: int = option(64, "Sequences running at once (per --dp replica).")
    max_num_batched_tokens: int = option(512, "Token budget per step (the largest compiled bucket).")
    min_token_bucket: int = option(
        0, "Smallest compiled token bucket; 0 = the platform's smallest efficient batch (CPU: 1 for float32, 8 for "
        "bfloat16; accelerators: 8).")
    max_prefill_chunk: int | None = option(None, "Per-request prefill chunk cap; 0: the token budget.", none_as=0)
    enable_prefix_caching: bool = option(True, "Reuse KV pages of shared prompt prefixes.")
    host_kv_cache_gb: float = option(
        0.0, "Host-memory KV tier under the prefix cache, in GiB (0: off): a cached block the device pool evicts is "
        "copied there and a prefix hit brings it back instead of recomputing it (per --dp replica). Needs "
        "--enable_prefix_caching; with a hybrid (sliding-window) KV cache a block moves with the window pages it still "
        "has. Not with --pp or a draft model.")
    hybrid_kv_cache: bool = option(
        True, "Sliding-window layers of a model that also has full-attention layers (Gemma 3) keep only their "
        "window's pages, in a page pool of their own; false: every layer keeps every page of a sequence (vLLM's "
        "--disable-hybrid-kv-cache-manager). Not with --pp.")
    kv_events_endpoint: str = option(
        "", "Publish the prefix cache's block stored / removed events, per tier, as vLLM's KV-event stream (msgpack "
        "KVEventBatch on ZMQ PUB) on this bind address, e.g. tcp://127.0.0.1:5557; empty: off. Loopback or ipc:// "
        "only unless --kv_events_allow_remote (the events carry prompt token ids).")
    kv_events_replay_endpoint: str = option(
        "", "ZMQ ROUTER bind address replaying recent event batches from a sequence number (vLLM's replay socket).")
    kv_events_block_hash: str = option(
        "id", "How the KV events name a block: id (this instance's block id; enough for a router that matches the "
        "events' token ids, e.g. Dynamo's or the gateway's) or vllm (vLLM's sha256_cbor chain hash as a 64-bit "
        "integer, seeded by $PYTHONHASHSEED or vLLM's default: for llm-d's precise-prefix-cache scorer, which "
        "computes vLLM's hashes from the prompt).")
    kv_events_allow_remote: bool = option(
        False, "Let the KV-event sockets bind a non-loopback address (a trusted network only: no authentication).")
    max_waiting_requests: int = option(1024, "Queue bound in requests (RESOURCE_EXHAUSTED beyond it).")
    max_waiting_tokens: int = option(1 << 22, "Queue bound in prompt tokens (RESOURCE_EXHAUSTED beyond it).")
    long_prompt_threshold: int = option(8192, "Prompts longer than this go through the long lane.")
    max_long_prefills: int = option(1, "Long prompts in prefill at once.")
    priority_ageing_s: float = option(10.0, "Ageing of lower priority classes, seconds per class.")
    seed: int = option(0, "Seed for requests that bring none.")
    async_scheduling: bool = option(
        True, "After a greedy step, schedule and launch the next one before its tokens reach the host (the next "
        "step's decodes read them on the device); single-device engines without speculative decoding.")
    compilation_cache_dir: str | None = option(
        None, "JAX persistent compilation cache (a restart loads its compiled programs); default "
        "$MESHSERVE_COMPILATION_CACHE or ~/.cache/meshserve/xla/<platform>; '' turns it off.")
    greedy_head_screen: bool = option(
        True, "Greedy steps of up to 4 sequences on the native CPU kernels take the LM head's argmax from an int8 copy "
        "of it plus an exact recheck of the rows its error bounds leave open (same tokens, a fraction of the read).")
    debug_step_delay_s: float = option(0.0, "Adds this much to every engine step (simulates a slow device).")
    tp: int = option(1, "Tensor-parallel degree (devices on the mesh's 'tensor' axis).")
    ep: int = option(1, "Expert-parallel degree (MoE models; devices on the 'expert' axis).")
    dp: int = option(
        1, "Data-parallel replicas inside the instance, each on its own --tp x --ep devices with its own scheduler "
        "and KV pages (--num_pages / --kv_cache_memory_gb are split over them; --max_num_seqs and the queue bounds "
        "are per replica). Not with --pp, speculative decoding or multi-host.")
    pp: int = option(1, "Pipeline stages (devices on the mesh's 'pipeline' axis; with --tp and --ep).")
    micro_batches: int = option(0, "Pipeline micro-batches per step; 0: --pp.")
    spare_expert_slots: int = option(0, "MoE: extra expert slots per layer for replicas of hot experts.")
    speculative_method: str = option(
        "", "Speculative decoding: 'draft' (--speculative_model proposes), 'ngram' (prompt lookup); empty: off.",
        choices=("",) + SPECULATIVE_METHODS)
    speculative_model: str = option("", "Draft model directory (same tokenizer as --model).")
    num_speculative_tokens: int = option(4, "Draft tokens per speculating sequence per step (k).")
    prompt_lookup_min: int = option(1, "Shortest n-gram prompt lookup matches (--speculative_method=ngram).")
    prompt_lookup_max: int = option(4, "Longest n-gram prompt lookup matches (--speculative_method=ngram).")
    speculative_disable_by_batch_size: int = option(
        0, "No speculation while this many requests or more are running; 0: never switched off by batch size.")
    speculative_min_acceptance: float = option(
        -1.0, "A request stops speculating (for a back-off period) when its acceptance rate falls below this; < 0: "
        "the break-even rate for k and the draft's cost.")
    # The platform the engine's programs are for: None = JAX's default backend. Another one ('gpu', 'tpu') builds
    # an engine whose programs can be lowered for it from this host (`Engine.lower_programs`), not run. Not a flag.
    platform: str | None = None
    enable_lora: bool = option(
        False, "Serve LoRA adapters of the model: --max_loras adapter slots on the device, requests name an adapter "
        "(docs/lora.md).")
    max_loras: int = option(4, "Adapters on the device at once (--enable_lora); more may be registered: the slots are "
                            "an LRU cache, loaded on demand.")
    max_lora_rank: int = option(16, "Largest adapter rank the slots hold (--enable_lora); a higher rank is refused.")
    lora_dtype: str = option(
        "", "How the adapter slots hold A and B (--enable_lora): empty: the model's dtype; int8: per rank row "
        "quantized int8, half bfloat16's bytes, for the native CPU kernel (one device, --max_lora_rank a multiple "
        "of 32; the update then moves by ~1% of its size; docs/lora.md).", choices=("", "int8"))
    lora_modules: str = option("", "Adapters registered at start-up (--enable_lora): name=path of a PEFT adapter "
                               "directory, comma-separated.")
    reasoning_parser: str = option(
        "", "How the model marks its reasoning (<think>...</think>): chat responses carry it as reasoning_content, "
        "usage counts its tokens, and a response_format or forced tool call applies only after it; empty: no "
        "reasoning; harmony: GPT-OSS's analysis / final channels (no constrained decoding with it).",
        choices=("",) + tuple(REASONING_FORMATS) + CHANNEL_REASONING)

    def __post_init__(self):
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(FLOAT_DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.min_token_bucket < 0:
            raise ValueError(f"EngineConfig.min_token_bucket must be >= 0 (0 = auto), got {self.min_token_bucket}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "tp", "ep", "dp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.host_kv_cache_gb < 0:
            raise ValueError(f"EngineConfig.host_kv_cache_gb must be >= 0 (0 = off), got {self.host_kv_cache_gb}")
        if self.kv_events_block_hash not in ("id", "vllm"):
            raise ValueError(f"kv_events_block_hash must be 'id' or 'vllm', got {self.kv_events_block_hash!r}")
        if self.kv_events_endpoint and self.dp > 1:
            raise ValueError(f"kv_events_endpoint={self.kv_events_endpoint!r} with dp={self.dp}: one KV-event stream "
                             f"per instance needs dp == 1 (each replica would bind it) in this version")
        if self.num_pages < 0 or self.kv_cache_memory_gb <= 0:
            raise ValueError("EngineConfig.num_pages must be >= 0 and kv_cache_memory_gb > 0")
        if self.speculative_method:
            self.speculative_config()  # validates
        if self.platform is not None:
            canonical_platform(self.platform)  # validates
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"EngineConfig.max_loras and max_lora_rank must be >= 1, got {self.max_loras}, "
                             f"{self.max_lora_rank}")
        if self.lora_dtype == "int8" and self.max_lora_rank % LORA_INT8_RANK_ROWS:
            raise ValueError(f"lora_dtype=int8 holds ranks in blocks of {LORA_INT8_RANK_ROWS}: max_lora_rank must be a "
                             f"multiple of {LORA_INT8_RANK_ROWS}, got {self.max_lora_rank}")
        if self.lora_dtype not in ("", "int8"):
            raise ValueError(f"lora_dtype must be '' (the model's dtype) or 'int8', got {self.lora_dtype!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError(f"lora_modules={self.lora_modules!r} needs enable_lora")
        if self.enable_lora and self.pp > 1:
            raise ValueError(f"enable_lora does not run with pipeline parallelism (pp={self.pp}) yet")
        self.lora_module_paths()  # validates

    def lora_module_paths(self) -> dict[str, str]:
        """`lora_modules` as {name: path}; a ValueError names an entry that is not name=path, or a repeated name."""
        out: dict[str, str] = {}
        for entry in filter(None, (e.strip() for e in self.lora_modules.split(","))):
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules entry {entry!r} is not name=path")
            if name.strip() in out:
                raise ValueError(f"lora_modules names adapter {name.strip()!r} twice")
            out[name.strip()] = path.strip()
        return out

    @property
    def kv_cache_dtype_name(self) -> str:
        """What the KV cache holds: the model's dtype ("auto"), else the quantized cache's format."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def speculative_config(self):
        """The SpeculativeConfig of these settings, or None when speculation is off."""
        if not self.speculative_method:
            return None
        return SpeculativeConfig(
            method=self.speculative_method, num_speculative_tokens=self.num_speculative_tokens,
            model=self.speculative_model, prompt_lookup_min=self.prompt_lookup_min,
            prompt_lookup_max=self.prompt_lookup_max, disable_by_batch_size=self.speculative_disable_by_batch_size,
            min_acceptance=self.speculative_min_acceptance)

    def platform_choices(self, num_devices: int | None = None, num_processes: int = 1) -> PlatformChoices:
        """The platform's choices for these settings (`serving.core.platform`); `num_devices` defaults to the
        devices these parallel degrees use."""
        from serving.core.platform import platform_choices  # JAX: not at import (the flags' --help)
        return platform_choices(self.platform, dtype=self.dtype, max_num_batched_tokens=self.max_num_batched_tokens,
                                min_bucket=self.min_token_bucket, greedy_head_screen=self.greedy_head_screen,
                                compilation_cache_dir=self.compilation_cache_dir,
                                num_devices=num_devices or self.tp * self.ep * self.pp, num_processes=num_processes)

    def token_buckets(self) -> list[int]:
        return list(self.platform_choices().token_buckets)
