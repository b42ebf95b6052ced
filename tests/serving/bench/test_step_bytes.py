"""The bytes a decode step reads (serving/bench/harness.py `decode_step_bytes`), the roofline behind the benchmarks'
step-time figures: every parameter as held but the embedding table, the LM head's int8 screen where a greedy step
takes it, and of each MoE layer's experts only those the step's tokens can select. Checked against the parameters
counted by hand on a real engine (a small random Mixtral with the native kernels, and with int8 experts)."""
import jax
import pytest
from flax import nnx

from serving.bench.harness import decode_step_bytes, decode_step_expert_bytes
from serving.core.llm import LLM
from tests.support import hf_models


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_moe_step_bytes_count_the_selectable_experts(tmp_path, quantization):
    d = hf_models.cached_dir(str(tmp_path), "mixtral")
    # not warmed up: the bytes are the loaded parameters', no program needs compiling
    llm = LLM(d, warmup=False, dtype="float32", page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32,
              enable_prefix_caching=False, **({"quantization": quantization} if quantization else {}))
    eng = llm.engine
    model = nnx.merge(eng.runner.graphdef, eng.runner.state)
    layers = [layer.mlp for layer in model.layers]
    slots, top_k = layers[0].gate_proj.shape[0], layers[0].top_k
    expert_names = [n for n in vars(layers[0]) if n.split("_scale")[0] in ("gate_proj", "up_proj", "down_proj")]
    assert ("gate_proj_scale" in expert_names) == (quantization == "int8")
    experts = sum(getattr(m, n)[...].nbytes for m in layers for n in expert_names)
    everything = sum(x.nbytes for x in jax.tree.leaves(eng.runner.state))
    embed, head = model.embed_tokens[...].nbytes, model.lm_head[...].nbytes
    screen = 0 if model.head_screen is None else model.head_screen[...].nbytes + model.head_screen_bounds[...].nbytes
    for batch in (1, 2, 4):
        selectable = experts * min(slots, batch * top_k) // slots
        assert decode_step_expert_bytes(model, batch) == (experts, selectable)
        want = everything - embed - screen - experts + selectable
        if eng.runner.screens(eng.runner.seq_bucket(batch)):
            want += screen - head
        assert decode_step_bytes(eng, batch) == want
    assert decode_step_expert_bytes(model, 1)[1] == experts * top_k // slots < experts
