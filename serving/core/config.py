"""EngineConfig: one engine's settings (model, dtype, KV pages, buckets, parallel degrees, speculation), validated
when built, and the token buckets they imply; SpeculativeConfig, the speculation settings."""
from __future__ import annotations

import dataclasses

from models.quant import WEIGHT_QUANTIZATIONS
from pallas_kernels.target import canonical_platform
from pallas_kernels.kv_quant import check_kv_cache_dtype
from serving.core.platform import DTYPES, PlatformChoices, platform_choices

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
    model: str  # HF directory, GGUF file or directory (models.gguf), or Orbax checkpoint (models.convert)
    dtype: str = "float32"  # parameter and activation dtype (and the KV cache's, when kv_cache_dtype is "auto")
    # Matmul weights quantized at load: "none" (as the checkpoint holds them: a pre-quantized checkpoint keeps its
    # scheme), "int8" or "fp8" (per-channel scales; models.quant)
    quantization: str = "none"
    kv_cache_dtype: str = "auto"  # "auto" (dtype), or a quantized cache: "int8", "fp8_e4m3" (pallas_kernels.kv_quant)
    page_size: int = 16
    num_pages: int = 0  # 0: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None  # default: the model's context, capped by the page pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    min_token_bucket: int = 0  # 0: the platform's smallest efficient matmul height (`platform.min_token_bucket`)
    max_prefill_chunk: int | None = None
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 22
    long_prompt_threshold: int = 8192
    max_long_prefills: int = 1
    priority_ageing_s: float = 10.0
    seed: int = 0
    # Greedy steps: launch the next step before this one's tokens reach the host (its decodes read them on device)
    async_scheduling: bool = True
    # JAX's persistent compilation cache: None = $MESHSERVE_COMPILATION_CACHE or ~/.cache/meshserve/xla/<platform>;
    # "" = off
    compilation_cache_dir: str | None = None
    # Greedy steps of few sequences on the native CPU kernels: the LM head's argmax from an int8 copy of it plus
    # the few rows its error bounds leave open (the same tokens, a quarter / an eighth of the head's read)
    greedy_head_screen: bool = True
    debug_step_delay_s: float = 0.0  # adds this much to every step (to simulate a slow device in tests)
    tp: int = 1  # tensor-parallel degree (devices on the mesh's 'tensor' axis)
    ep: int = 1  # expert-parallel degree (MoE models; devices on the 'expert' axis)
    dp: int = 1  # data-parallel replicas inside the instance (serving.core.data_parallel)
    pp: int = 1  # pipeline stages (serving.core.pipeline_runner)
    micro_batches: int = 0  # pipeline micro-batches per step; 0 = pp
    spare_expert_slots: int = 0  # MoE: extra physical slots per layer for replicas of hot experts
    # Speculative decoding (serving.core.speculative): "" = off, "draft" (speculative_model) or "ngram"
    speculative_method: str = ""
    speculative_model: str = ""
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    speculative_disable_by_batch_size: int = 0
    speculative_min_acceptance: float = -1.0  # < 0: the break-even rate for k and the draft's cost
    # The platform the engine's programs are for: None = JAX's default backend. Another one ('gpu', 'tpu') builds
    # an engine whose programs can be lowered for it from this host (`Engine.lower_programs`), not run.
    platform: str | None = None
    # How the model marks its reasoning ("" = it does not; "deepseek_r1", "qwen3": serving.core.structured): a
    # grammar asked to apply after the reasoning leaves the reasoning free
    reasoning_parser: str = ""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.min_token_bucket < 0:
            raise ValueError(f"EngineConfig.min_token_bucket must be >= 0 (0 = auto), got {self.min_token_bucket}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "tp", "ep", "dp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 0 or self.kv_cache_memory_gb <= 0:
            raise ValueError("EngineConfig.num_pages must be >= 0 and kv_cache_memory_gb > 0")
        if self.speculative_method:
            self.speculative_config()  # validates
        if self.platform is not None:
            canonical_platform(self.platform)  # validates

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
        return platform_choices(self.platform, dtype=self.dtype, max_num_batched_tokens=self.max_num_batched_tokens,
                                min_bucket=self.min_token_bucket, greedy_head_screen=self.greedy_head_screen,
                                compilation_cache_dir=self.compilation_cache_dir,
                                num_devices=num_devices or self.tp * self.ep * self.pp, num_processes=num_processes)

    def token_buckets(self) -> list[int]:
        return list(self.platform_choices().token_buckets)
