#!/usr/bin/env python3
"""An independent float32 evaluation of one MoE layer of a Hugging Face checkpoint, in numpy.

It shares no code with moeinfer: it parses safetensors itself, decodes BF16 / FP8 E4M3 / NVFP4
itself, names the tensors per family itself, and computes each family's block the way the
transformers modules do (fp32 scores, torch.topk semantics, the family's weighting). It then
compares with moeinfer's output.

  moe_numpy.py --moeinfer BIN --make-checkpoint BIN --workdir DIR   # every family x layout
  moe_numpy.py --checkpoint DIR --layer L --input IN --output OUT   # one comparison

Exit code 0 when every relative L2 error is <= the tolerance (1e-4: fp32 activations; a backend
that rounds activations to bf16, as the CUDA expert-major path does, needs --tolerance 1e-2, the
bound derived in tests/test_backend_ops.cpp), 1 otherwise, 77 when numpy is missing.
"""
import argparse
import json
import os
import struct
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("SKIPPED: numpy is not installed (apt-get install python3-numpy)")
    sys.exit(77)

TOLERANCE = 1e-4

# ---- safetensors and the formats ----------------------------------------------------------------

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8, "U8": np.uint8,
          "I32": np.int32, "I64": np.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, t = e["data_offsets"]
        arr = np.frombuffer(blob[base + b:base + t], dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
        out[name] = (e["dtype"], arr)
    return out


def bf16(a):
    return (a.astype(np.uint32) << 16).view(np.float32)


def e4m3(a):
    a = a.astype(np.int32)
    s = np.where(a & 0x80, -1.0, 1.0)
    e = (a >> 3) & 0xF
    m = a & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return (s * v).astype(np.float32)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def to_float(dtype, a):
    if dtype == "BF16":
        return bf16(a)
    if dtype == "F8_E4M3":
        return e4m3(a)
    return a.astype(np.float32)


class Tensors:
    def __init__(self, d):
        self.t = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                self.t.update(read_safetensors(os.path.join(d, f)))

    def has(self, n):
        return n in self.t

    def f(self, n):
        dtype, a = self.t[n]
        return to_float(dtype, a)

    def linear(self, m):
        """Module m's weight [out, in] as float32, whatever the layout."""
        if self.has(m + ".weight_packed"):  # compressed-tensors: global scale stored as 1 / g
            return self.nvfp4(self.t[m + ".weight_packed"][1], self.t[m + ".weight_scale"][1],
                              1.0 / self.f(m + ".weight_global_scale").reshape(-1)[0])
        dtype, w = self.t[m + ".weight"]
        if dtype == "U8":  # ModelOpt
            return self.nvfp4(w, self.t[m + ".weight_scale"][1], self.f(m + ".weight_scale_2").reshape(-1)[0])
        if dtype == "F8_E4M3":
            q = e4m3(w)
            if self.has(m + ".weight_scale_inv"):
                s = self.f(m + ".weight_scale_inv")
                s = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:q.shape[0], :q.shape[1]]
                return (q * s).astype(np.float32)
            s = self.f(m + ".weight_scale")
            return (q * (s.reshape(-1, 1) if s.size > 1 else s.reshape(()))).astype(np.float32)
        return to_float(dtype, w)

    @staticmethod
    def nvfp4(packed, scales, g):
        o, half = packed.shape
        codes = np.empty((o, 2 * half), dtype=np.uint8)
        codes[:, 0::2] = packed & 0xF  # element 2i in the low nibble
        codes[:, 1::2] = packed >> 4
        block = np.repeat(e4m3(scales), 16, axis=1)
        return ((E2M1[codes] * block) * np.float32(g)).astype(np.float32)


# ---- the blocks ----------------------------------------------------------------------------------

def sigmoid(v):
    return (1.0 / (1.0 + np.exp(-v))).astype(np.float32)


def softmax(v):
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def topk(v, k):
    """torch.topk indices: largest first, equal values in index order."""
    idx = np.argsort(-v, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(v, idx, axis=-1), idx


def mlp(x, g, u, d, gb=None, ub=None, db=None, clamp=None):
    a, b = x @ g.T, x @ u.T
    if gb is not None:
        a, b = a + gb, b + ub
    if clamp is None:
        h = a * sigmoid(a) * b
    else:  # gpt-oss
        a = np.minimum(a, clamp)
        b = np.clip(b, -clamp, clamp)
        h = (b + 1) * (a * sigmoid(a * 1.702))
    y = h @ d.T
    return y + db if db is not None else y


def layer_forward(ckpt_dir, layer, x):
    cfg = json.load(open(os.path.join(ckpt_dir, "config.json")))
    nested = "text_config" in cfg
    c = cfg["text_config"] if nested else cfg
    mt = c.get("model_type", cfg.get("model_type"))
    T = Tensors(ckpt_dir)
    p = ("language_model.model.layers.%d." if nested else "model.layers.%d.") % layer
    E = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
    k = c.get("num_experts_per_tok") or c.get("moe_topk")
    n = x.shape[0]
    out = np.zeros_like(x)
    proj = ("gate_proj", "up_proj", "down_proj")

    def routed(ids, w, experts, input_scale=False, clamp=None):
        res = np.zeros_like(x)
        for e in range(E):
            rows, slots = np.nonzero(ids == e)
            if rows.size == 0:
                continue
            xin = x[rows] * (w[rows, slots][:, None] if input_scale else 1.0)
            y = mlp(xin, *experts(e), clamp=clamp) if clamp is None else experts(e, xin, clamp)
            res[rows] += y if input_scale else y * w[rows, slots][:, None]
        return res

    def per_expert(prefix, names):
        return lambda e: [T.linear("%s%d.%s" % (prefix, e, q)) for q in names]

    if mt in ("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "mixtral", "minimax_m2"):
        block = "block_sparse_moe." if mt in ("mixtral", "minimax_m2") else "mlp."
        logits = x @ T.linear(p + block + "gate").T
        names = ("w1", "w3", "w2") if block.startswith("block") else proj
        if mt == "minimax_m2":
            s = sigmoid(logits)
            _, ids = topk(s + T.f(p + block + "e_score_correction_bias"), k)
            w = np.take_along_axis(s, ids, -1)
            w = w / w.sum(-1, keepdims=True)
        else:
            w, ids = topk(softmax(logits), k)
            norm = {"mixtral": True, "qwen3_next": True}.get(mt, False)
            if c.get("norm_topk_prob", norm) or mt == "mixtral":
                w = w / w.sum(-1, keepdims=True)
        out = routed(ids, w, per_expert(p + block + "experts.", names))
        if c.get("shared_expert_intermediate_size") and mt in ("qwen2_moe", "qwen3_next"):
            sh = mlp(x, *[T.linear(p + "mlp.shared_expert." + q) for q in proj])
            gate = sigmoid(x @ T.f(p + "mlp.shared_expert_gate.weight").reshape(1, -1).T)
            out = out + gate * sh
    elif mt in ("deepseek_v3", "kimi_k2", "glm4_moe"):
        s = sigmoid(x @ T.linear(p + "mlp.gate").T)
        choice = s + T.f(p + "mlp.gate.e_score_correction_bias")
        G, TG = c.get("n_group", 1), c.get("topk_group", 1)
        gs = np.sort(choice.reshape(n, G, E // G), axis=-1)[..., -2:].sum(-1)
        _, gidx = topk(gs, TG)
        mask = np.zeros((n, G), dtype=bool)
        np.put_along_axis(mask, gidx, True, -1)
        choice = np.where(np.repeat(mask, E // G, axis=1), choice, -np.inf)
        _, ids = topk(choice, k)
        w = np.take_along_axis(s, ids, -1)
        if c.get("norm_topk_prob", True):
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        w = w * c.get("routed_scaling_factor", 2.5 if mt != "glm4_moe" else 1.0)
        out = routed(ids, w.astype(np.float32), per_expert(p + "mlp.experts.", proj))
        if c.get("n_shared_experts"):
            out = out + mlp(x, *[T.linear(p + "mlp.shared_experts." + q) for q in proj])
    elif mt == "longcat_flash":
        s = softmax(x @ T.linear(p + "mlp.router.classifier").T)
        _, ids = topk(s + T.f(p + "mlp.router.e_score_correction_bias"), k)
        w = np.take_along_axis(s, ids, -1) * c["routed_scaling_factor"]
        out = routed(np.where(ids < E, ids, -1), w, per_expert(p + "mlp.experts.", proj))
        zero = ids >= E  # identity experts
        out = out + (w * zero).sum(-1, keepdims=True) * x
    elif mt == "gpt_oss":
        logits = x @ T.linear(p + "mlp.router").T + T.f(p + "mlp.router.bias")
        top, ids = topk(logits, k)
        w = softmax(top)
        gu, dn = T.f(p + "mlp.experts.gate_up_proj"), T.f(p + "mlp.experts.down_proj")
        gub, dnb = T.f(p + "mlp.experts.gate_up_proj_bias"), T.f(p + "mlp.experts.down_proj_bias")

        def expert(e, xin, clamp):
            y = xin @ gu[e] + gub[e]
            a, b = np.minimum(y[:, 0::2], clamp), np.clip(y[:, 1::2], -clamp, clamp)
            return ((b + 1) * (a * sigmoid(a * 1.702))) @ dn[e] + dnb[e]
        out = routed(ids, w, expert, clamp=c.get("swiglu_limit", 7.0))
    elif mt in ("llama4", "llama4_text"):
        logits = x @ T.linear(p + "feed_forward.router").T
        top, ids = topk(logits, k)
        w = sigmoid(top)
        gu, dn = T.f(p + "feed_forward.experts.gate_up_proj"), T.f(p + "feed_forward.experts.down_proj")
        I = gu.shape[2] // 2
        experts = lambda e: [gu[e][:, :I].T, gu[e][:, I:].T, dn[e].T]
        out = routed(ids, w, experts, input_scale=True)
        out = out + mlp(x, *[T.linear(p + "feed_forward.shared_expert." + q) for q in proj])
    else:
        raise SystemExit("unknown model_type %s" % mt)
    return out.astype(np.float32)


def compare(ckpt, layer, inp, outp):
    x_dtype, x = read_safetensors(inp)["hidden_states"]
    x = to_float(x_dtype, x)
    _, got = read_safetensors(outp)["hidden_states"]
    want = layer_forward(ckpt, layer, x)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


FAMILIES = ["qwen3_next", "qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "kimi_k2", "glm4_moe",
            "minimax_m2", "longcat_flash", "gpt_oss", "llama4"]
LAYOUTS = ["bf16", "modelopt_nvfp4", "modelopt_nvfp4_hfquant", "compressed_nvfp4", "deepseek_fp8"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moeinfer")
    ap.add_argument("--make-checkpoint")
    ap.add_argument("--workdir")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--path", help="force a CUDA path (moeinfer run --path)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    ap.add_argument("--checkpoint")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--input")
    ap.add_argument("--output")
    a = ap.parse_args()
    if a.checkpoint:
        err = compare(a.checkpoint, a.layer, a.input, a.output)
        print("relative L2 error %.3e" % err)
        return 0 if err <= a.tolerance else 1
    failures = 0
    print("%-14s %-24s %12s" % ("family", "layout", "rel L2"))
    for fam in FAMILIES:
        for layout in LAYOUTS:
            if fam in ("gpt_oss", "llama4") and layout != "bf16":
                continue  # fused expert tensors are BF16 only
            d = os.path.join(a.workdir, fam + "_" + layout)
            subprocess.run([a.make_checkpoint, d, fam, layout], check=True)
            outp = os.path.join(d, "output.safetensors")
            run = [a.moeinfer, "run", "--checkpoint", d, "--layer", "1", "--input",
                   os.path.join(d, "input.safetensors"), "--output", outp, "--backend", a.backend]
            subprocess.run(run + (["--path", a.path] if a.path else []), check=True, stdout=subprocess.DEVNULL)
            err = compare(d, 1, os.path.join(d, "input.safetensors"), outp)
            ok = err <= a.tolerance
            failures += not ok
            print("%-14s %-24s %12.3e %s" % (fam, layout, err, "ok" if ok else "FAILED"))
    print("%d passed, %d failed" % (52 - failures, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
