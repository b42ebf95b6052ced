"""The model code: HF config parsing, the decoder-only transformer in Flax NNX (layers, attention, MoE, RoPE), weight
loading (safetensors, Orbax), the tokenizer, local test models and the tiny models' training (`models.training`)."""
