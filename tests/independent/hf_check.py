#!/usr/bin/env python3
"""The Hugging Face blocks themselves (transformers, float32) on the tiny test checkpoints,
compared with the outputs moeinfer wrote there (moe_numpy.py --workdir DIR must have run first).

For each family it instantiates the transformers MoE block of that model_type from the
checkpoint's config.json, fills its parameters from the checkpoint (dequantized by
moe_numpy.Tensors), runs the input, and reports the relative L2 error against moeinfer's
output. Needs torch and transformers (the GPU machine has both).

  hf_check.py --workdir DIR
"""
import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from moe_numpy import FAMILIES, LAYOUTS, TOLERANCE, Tensors, read_safetensors, to_float  # noqa: E402

try:
    import torch
    import transformers
except ImportError as e:
    print("SKIPPED: %s" % e)
    sys.exit(77)

# model_type -> (transformers module, block class, block's tensor prefix in the checkpoint,
#                expert projection names)
BLOCKS = {
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeSparseMoeBlock", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_next": ("qwen3_next", "Qwen3NextSparseMoeBlock", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("olmoe", "OlmoeSparseMoeBlock", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("mixtral", "MixtralSparseMoeBlock", "block_sparse_moe.", ("w1", "w3", "w2")),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3MoE", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "kimi_k2": ("deepseek_v3", "DeepseekV3MoE", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ("glm4_moe", "Glm4MoeMoE", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "minimax_m2": ("minimax_m2", "MiniMaxM2SparseMoeBlock", "block_sparse_moe.", ("w1", "w3", "w2")),
    "longcat_flash": ("longcat_flash", "LongcatFlashMoE", "mlp.", ("gate_proj", "up_proj", "down_proj")),
    "gpt_oss": ("gpt_oss", "GptOssMLP", "mlp.", None),
    "llama4": ("llama4", "Llama4TextMoe", "feed_forward.", None),
}


def hf_block(ckpt, layer):
    raw = json.load(open(os.path.join(ckpt, "config.json")))
    mt = raw["model_type"]
    module, cls, block_prefix, proj = BLOCKS[mt]
    cfg_dict = raw["text_config"] if "text_config" in raw else raw
    cfg_type = "llama4_text" if mt == "llama4" else module
    config = transformers.CONFIG_MAPPING[cfg_type].from_dict({k: v for k, v in cfg_dict.items() if k != "model_type"})
    block = getattr(importlib.import_module("transformers.models.%s.modeling_%s" % (module, module)), cls)(config)
    T = Tensors(ckpt)
    p = ("language_model.model.layers.%d." if "text_config" in raw else "model.layers.%d.") % layer + block_prefix
    E = getattr(config, "n_routed_experts", None) or getattr(config, "num_local_experts", None) or config.num_experts
    state = {}
    for name, t in block.state_dict().items():
        if name in ("gate.weight", "router.weight", "router.classifier.weight"):
            v = T.linear(p + name[: -len(".weight")])
        elif name.endswith("e_score_correction_bias") or name == "router.bias" or (proj is None and name.startswith("experts.")):
            # The same names in HF and in the checkpoint; gpt-oss and Llama-4 experts keep HF's
            # own fused layout there.
            v = T.f(p + name)
        elif name == "experts.gate_up_proj":  # [E(+Z), 2I, H]: gate rows then up rows
            v = np.zeros(tuple(t.shape), dtype=np.float32)
            for e in range(E):
                v[e] = np.concatenate([T.linear("%sexperts.%d.%s" % (p, e, proj[0])),
                                       T.linear("%sexperts.%d.%s" % (p, e, proj[1]))])
        elif name == "experts.down_proj":  # [E, H, I]
            v = np.stack([T.linear("%sexperts.%d.%s" % (p, e, proj[2])) for e in range(E)])
        elif name == "shared_expert_gate.weight":
            v = T.f(p + name).reshape(1, -1)
        elif name.startswith("shared_expert"):
            v = T.linear(p + name[: -len(".weight")])
        else:
            raise SystemExit("%s: no checkpoint tensor for HF parameter %s" % (mt, name))
        if tuple(v.shape) != tuple(t.shape):
            raise SystemExit("%s: %s has shape %s, HF wants %s" % (mt, name, v.shape, tuple(t.shape)))
        state[name] = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
    block.load_state_dict(state, strict=True)
    return block.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    a = ap.parse_args()
    torch.manual_seed(0)
    failures = checked = 0
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    print("%-14s %-24s %12s" % ("family", "layout", "rel L2"))
    for fam in FAMILIES:
        for layout in LAYOUTS:
            d = os.path.join(a.workdir, fam + "_" + layout)
            if not os.path.exists(os.path.join(d, "output.safetensors")):
                continue
            dtype, x = read_safetensors(os.path.join(d, "input.safetensors"))["hidden_states"]
            x = to_float(dtype, x)
            got = read_safetensors(os.path.join(d, "output.safetensors"))["hidden_states"][1]
            with torch.no_grad():
                out = hf_block(d, 1)(torch.from_numpy(x.copy()).reshape(1, *x.shape))
            out = (out[0] if isinstance(out, tuple) else out).reshape(x.shape).numpy()
            err = float(np.linalg.norm(got - out) / max(np.linalg.norm(out), 1e-30))
            ok = err <= a.tolerance
            failures += not ok
            checked += 1
            print("%-14s %-24s %12.3e %s" % (fam, layout, err, "ok" if ok else "FAILED"))
    print("%d passed, %d failed" % (checked - failures, failures))
    return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
