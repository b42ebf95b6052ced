"""References for quantized weights: an HF model whose matmul weights are replaced by their quantize-dequantize
round trip (what our quantized model computes with), in place."""
from __future__ import annotations

import re

import numpy as np
import torch

from models.quant import WeightQuant, dequantize, quantize

# The HF parameters meshserve quantizes: attention projections, dense / shared-expert MLPs (Phi-3's fused ones: per
# output row, as each part's own) and the experts (the router, the shared-expert gate, the embedding and the LM head
# stay float).
QUANTIZED_HF = re.compile(r"(self_attn\.([qkvo]|qkv)_proj\.weight|"
                          r"mlp\.(shared_expert\.)?(gate|up|down|gate_up)_proj\.weight|"
                          r"experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight|"
                          r"experts\.(gate_up_proj|down_proj)$)")


def fake_quantize_hf(model: torch.nn.Module, quant: WeightQuant) -> list[str]:
    """Replaces each quantized HF weight ([..., out, in]: scales per output row, or per group of input columns)
    by dequantize(quantize(w)); returns the names replaced."""
    done = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not QUANTIZED_HF.search(name):
                continue
            w = p.detach().float().numpy()
            # quantize wants the contracting axis before the output ones: [..., in, out]
            wt = np.swapaxes(w, -1, -2)
            axis = (wt.ndim - 2,)
            values, scale = quantize(wt, axis, quant)
            p.copy_(torch.from_numpy(np.swapaxes(dequantize(values, scale, axis, quant.group), -1, -2).copy()))
            done.append(name)
    return done
