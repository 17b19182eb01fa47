#!/usr/bin/env python3
"""Writes tests/fixtures/tiny-c: a tiny DiffusionGemma checkpoint that is WELL-CONDITIONED, so a bf16 backend must
generate exactly what the f32 CPU oracle generates (issue 5: "generation identical where the CPU run has no
near-ties"). The random fixtures tiny-{a,b,v,g} are chaotic (router near-ties, peaky attention, see
docs/BENCHMARKS.md 2026-11-29), so their end-to-end generations legitimately diverge under bf16 rounding.

Pure Python 3 standard library (no torch / numpy): BF16 tensors are packed with struct, from random.Random(SEED).
    python3 tools/reference/make_conditioned_fixture.py [--out tests/fixtures/tiny-c]
Deterministic: the same script writes the same bytes.

Conditioning by construction (what tests/test_conditioned_fixture.cpp then measures on the CPU backend):
  * embedding rows = c_g + d_v: token v belongs to group g = v % 2, c_0 / c_1 are two orthogonal "group" directions
    shared by the group, d_v a distinct random part. The tied lm_head compares h . d_v across the vocabulary, and
    the residual stream is dominated by the canvas token's own row, so each row's argmax wins by a clear margin
    (the shared c_g cancels within a group and separates the groups);
  * branches (attention, dense MLP + MoE) enter the residual through post norms of weight ~0.2, so they move the
    logits smoothly by O(0.1-1) instead of flipping them;
  * router.proj rows = a_e^(0) * u_0 + a_e^(1) * u_1 + small noise with u_g the router's view of c_g: each group gets
    its own top-2 experts per layer (a permutation of the strengths per layer) with a 2nd-vs-3rd gap of several
    logits, so no routing decision is anywhere near a tie;
  * q_norm / k_norm weights U(0.2, 0.4): attention scores (no 1/sqrt(d)) of O(1), soft, not one-hot;
  * self-conditioning down_proj x0.02: the SC loop is contractive (the previous step's softmax barely moves x).
"""
import argparse
import json
import math
import os
import random
import struct

SEED = 20261130
S, F = "sliding_attention", "full_attention"
V, H, I, IE = 256, 64, 96, 32
NH, E, K = 4, 8, 2
LAYERS = [S, S, S, F]
SLIDING = dict(head_dim=16, kv=2)
FULL = dict(head_dim=32, kv=1)
WINDOW, CANVAS = 12, 16
D_SCALE = 0.40      # per-dim std of the distinct part d_v of an embedding row
C_SCALE = 0.40      # per-dim magnitude of the group directions c_g
BRANCH = (0.08, 0.12)  # post_attention_layernorm / post_feedforward_layernorm weights
ROUTER_STRENGTH = [9.0, 7.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]  # per group, permuted per layer and group
FINAL_NORM = (0.9, 1.0)  # keeps the logits (~15) below the softcap (30), where top values would compress
ROUTER_NOISE = 0.1  # per-dim std of the router rows' unstructured part

def bf16_bits(x):
    """float -> bf16 bits, round to nearest even (what torch's .to(bfloat16) does for finite values)."""
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF

class Builder:
    def __init__(self, seed):
        self.r = random.Random(seed)
        self.tensors = {}  # name -> (shape, flat list)

    def add(self, name, shape, values):
        n = 1
        for s in shape:
            n *= s
        assert len(values) == n, (name, shape, len(values))
        self.tensors[name] = (list(shape), values)

    def normal(self, n, std):
        return [self.r.gauss(0.0, std) for _ in range(n)]

    def uniform(self, n, lo, hi):
        return [self.r.uniform(lo, hi) for _ in range(n)]

    def linear(self, name, out_f, in_f, gain=1.0):
        self.add(name, [out_f, in_f], self.normal(out_f * in_f, gain / math.sqrt(in_f)))

    def write(self, path):
        header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
        for name in sorted(self.tensors):
            shape, vals = self.tensors[name]
            blob = struct.pack("<%dH" % len(vals), *(bf16_bits(v) for v in vals))
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + len(blob)]}
            blobs.append(blob)
            off += len(blob)
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)  # 8-byte aligned data section, as safetensors writers do
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for b in blobs:
                f.write(b)

def unit(v):
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]

def build(b):
    r = b.r
    # Two orthogonal group directions (Gram-Schmidt), scaled to C_SCALE per dim.
    g0 = unit([r.gauss(0, 1) for _ in range(H)])
    g1 = [r.gauss(0, 1) for _ in range(H)]
    dot = sum(x * y for x, y in zip(g0, g1))
    g1 = unit([y - dot * x for x, y in zip(g0, g1)])
    groups = [[x * C_SCALE * math.sqrt(H) for x in g0], [x * C_SCALE * math.sqrt(H) for x in g1]]
    embed = []
    for v in range(V):
        c = groups[v % 2]
        d = [r.gauss(0, D_SCALE) for _ in range(H)]
        for g in (g0, g1):  # d_v orthogonal to both group directions: c . d_v would add noise to the margins
            dot = sum(x * y for x, y in zip(g, d))
            d = [y - dot * x for x, y in zip(g, d)]
        embed += [c[i] + d[i] for i in range(H)]
    b.add("model.decoder.embed_tokens.weight", [V, H], embed)
    b.add("model.decoder.norm.weight", [H], b.uniform(H, FINAL_NORM[0], FINAL_NORM[1]))

    sc = "model.decoder.self_conditioning."
    b.add(sc + "pre_norm.weight", [H], b.uniform(H, 0.8, 1.2))
    b.linear(sc + "gate_proj.weight", I, H)
    b.linear(sc + "up_proj.weight", I, H)
    b.linear(sc + "down_proj.weight", H, I, gain=0.02)  # contractive SC loop

    for l, kind in enumerate(LAYERS):
        shp = FULL if kind == F else SLIDING
        D, KV = shp["head_dim"], shp["kv"]
        p = "model.decoder.layers.%d." % l
        b.linear(p + "self_attn.q_proj.weight", NH * D, H)
        b.linear(p + "self_attn.k_proj.weight", KV * D, H)
        if kind == S:  # full layers use the raw k_proj output as V
            b.linear(p + "self_attn.v_proj.weight", KV * D, H)
        b.linear(p + "self_attn.o_proj.weight", H, NH * D)
        b.add(p + "self_attn.q_norm.weight", [D], b.uniform(D, 0.2, 0.4))  # soft attention
        b.add(p + "self_attn.k_norm.weight", [D], b.uniform(D, 0.2, 0.4))
        for n in ("input_layernorm", "pre_feedforward_layernorm", "pre_feedforward_layernorm_2",
                  "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
            b.add(p + n + ".weight", [H], b.uniform(H, 0.8, 1.2))
        for n in ("post_attention_layernorm", "post_feedforward_layernorm"):
            b.add(p + n + ".weight", [H], b.uniform(H, *BRANCH))  # branches perturb, the token row dominates
        b.linear(p + "mlp.gate_proj.weight", I, H)
        b.linear(p + "mlp.up_proj.weight", I, H)
        b.linear(p + "mlp.down_proj.weight", H, I)
        # Router: the CPU reads RMSNorm_noscale(h) * scale * H^-0.5; its view of group g is u_g = c_g * scale
        # (normalised). Rows a_e^(g) * u_g give each group its own top-2 with a gap of several logits.
        rscale = b.uniform(H, 0.8, 1.2)
        b.add(p + "router.scale", [H], rscale)
        u = [unit([c[i] * rscale[i] for i in range(H)]) for c in groups]
        a = [ROUTER_STRENGTH[:], ROUTER_STRENGTH[:]]
        r.shuffle(a[0])
        # group 1 takes two experts group 0 does not pick first, so both groups exercise different experts
        a[1] = a[0][2:] + a[0][:2]
        proj = []
        for e in range(E):
            proj += [a[0][e] * u[0][i] + a[1][e] * u[1][i] + r.gauss(0, ROUTER_NOISE) for i in range(H)]
        # u_g has unit norm and the router input's c_g share has norm ~0.7 * H^0.5 / H^0.5: scale so a strength
        # unit is ~one logit.
        proj = [x * 3.0 for x in proj]
        b.add(p + "router.proj.weight", [E, H], proj)
        b.add(p + "router.per_expert_scale", [E], b.uniform(E, 0.8, 1.2))
        b.add(p + "experts.gate_up_proj", [E, 2 * IE, H], b.normal(E * 2 * IE * H, 1 / math.sqrt(H)))
        b.add(p + "experts.down_proj", [E, H, IE], b.normal(E * H * IE, 1 / math.sqrt(IE)))
        # decoder != encoder scalars, both != 1, so a scalar mix-up stays visible
        b.add(p + "layer_scalar", [1], [r.uniform(0.9, 1.1)])
        b.add("model.encoder.language_model.layers.%d.layer_scalar" % l, [1], [r.uniform(0.6, 0.8)])

def config():
    # The 5.17 config.json form (per_layer_config), same structure as tests/fixtures/tiny-a/config.json.
    vision = {
        "_name_or_path": "", "architectures": None, "attention_bias": False, "attention_dropout": 0.0,
        "chunk_size_feed_forward": 0, "dtype": None, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 16, "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "initializer_range": 0.02,
        "intermediate_size": 32, "is_encoder_decoder": False, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        "max_position_embeddings": 131072, "model_type": "gemma4_vision", "num_attention_heads": 2,
        "num_hidden_layers": 1, "num_key_value_heads": 2, "output_attentions": False,
        "output_hidden_states": False, "patch_size": 16, "pooling_kernel_size": 3,
        "position_embedding_size": 10240, "problem_type": None, "return_dict": True, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"}, "standardize": False,
        "use_clipped_linears": False}
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2, "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "head_dim": SLIDING["head_dim"], "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I, "layer_types": LAYERS,
        "max_position_embeddings": 131072, "model_type": "diffusion_gemma_text", "moe_intermediate_size": IE,
        "num_attention_heads": NH, "num_experts": E, "num_hidden_layers": len(LAYERS),
        "num_key_value_heads": SLIDING["kv"], "pad_token_id": 0,
        "per_layer_config": {str(l): {"head_dim": FULL["head_dim"], "num_key_value_heads": FULL["kv"]}
                             for l, k in enumerate(LAYERS) if k == F},
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": WINDOW, "tie_word_embeddings": True, "top_k_experts": K,
        "use_bidirectional_attention": "vision", "vocab_size": V}
    return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "boi_token_id": 255999, "canvas_length": CANVAS,
            "dtype": "bfloat16", "eoi_token_id": 258882, "image_token_id": 258880, "initializer_range": 0.02,
            "model_type": "diffusion_gemma", "text_config": text, "tie_word_embeddings": True,
            "transformers_version": "5.17.0", "vision_config": vision}

GENERATION = {"confidence_threshold": None, "max_denoising_steps": None, "return_dict_in_generate": True,
              "sampler_config": None, "stability_threshold": None, "t_max": None, "t_min": None,
              "transformers_version": "5.17.0"}

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures",
                                                   "tiny-c"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    b = Builder(SEED)
    build(b)
    b.write(os.path.join(args.out, "model.safetensors"))
    for name, obj in (("config.json", config()), ("generation_config.json", GENERATION)):
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    print("wrote", os.path.abspath(args.out), os.path.getsize(os.path.join(args.out, "model.safetensors")), "bytes")

if __name__ == "__main__":
    main()
