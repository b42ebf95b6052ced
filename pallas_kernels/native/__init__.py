"""Native CPU kernels (C++ in this directory) called from XLA:CPU programs through the XLA FFI. `library`: their build
into a cache, load and per-CPU instruction-set choice (`build`, `enabled`, `isa`); `packing`: the weight layouts they
read (`pack_weights`, the LM head's screen); `wrappers`: the calls `matmul`, `matmul_packed`, `matmul_int8`,
`greedy_head`, `ragged_paged_attention`, `expert_mlp` and `lora`. Each module's public names are importable from here.
Details: docs/native-kernels.md."""
from pallas_kernels.native.library import (ARCH_ISAS, CACHE_ENV, ENV_VAR, FFI_TARGETS, ISA_ENV_VAR, ISAS, PATHS_ENV,
                                           SOURCE_DIR, build, build_selftest, compile_jobs, cpu_paths, enabled,
                                           env_var, int8_dot_runs, isa, kernel_objects, machine, machine_reason, main,
                                           pair_dot, run_jobs, runnable_isas, unavailable_reason, use_isa)
from pallas_kernels.native.packing import (BF16_K_ALIGN, PANELS, SCREEN_K_ALIGN, can_pack, greedy_head_screen,
                                           huge_page_buffer, is_packed, is_packed_experts, pack_weight, pack_weights,
                                           packed_host, packed_shape, screen_width, unpack_experts, unpack_weight)
from pallas_kernels.native.wrappers import (HEAD_LAYOUTS, INT8_ENV_VAR, INT8_METHODS, MAX_INT8_ROWS, MAX_MATMUL_ROWS,
                                            attention_supported, expert_mlp, expert_mlp_supported, greedy_head,
                                            greedy_head_supported, int8_method, latent_attention,
                                            latent_attention_supported, lora, lora_int8, lora_int8_parts, lora_parts,
                                            lora_int8_supported, lora_supported, matmul, matmul_int8,
                                            matmul_int8_supported, matmul_packed, matmul_supported, packed_supported,
                                            ragged_paged_attention, scale_groups)
