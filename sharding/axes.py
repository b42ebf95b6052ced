"""Logical axis names that model parameters and activations carry.

Model code names only these; `sharding` maps them to mesh axes ('data', 'pipeline', 'tensor', 'expert').
"""
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
EXPERT = "expert"
LAYERS = "layers"
LORA_SLOTS = "lora_slots"  # the adapter slots of a LoRA stack (serving.core.lora)
LORA_RANK = "lora_rank"  # a LoRA stack's rank axis
KV_PAGES = "kv_pages"  # the KV cache's page axis (each data replica holds its own pool)

LOGICAL_AXES = (EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, EXPERT, LAYERS, KV_PAGES, LORA_SLOTS, LORA_RANK)
