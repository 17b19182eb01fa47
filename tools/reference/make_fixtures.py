#!/usr/bin/env python3
"""Builds the tiny random DiffusionGemma checkpoints and HF transformers reference tensors under tests/fixtures/.

Runs on the GPU machine (transformers 5.17 + torch; CPU tensors are enough):
    HF_HUB_OFFLINE=1 python3 tools/reference/make_fixtures.py --out tests/fixtures

For each config it writes <out>/<name>/ = an HF snapshot (config.json, generation_config.json, model.safetensors in
bf16, saved with save_pretrained) and <out>/<name>/reference/{case.json, ref.safetensors}:
  * the prompt is prefilled; K/V of every layer after the prefill (what the HF cache holds: the last W-1 positions on
    sliding layers, everything on full layers);
  * decoder logits for a fixed canvas without SC, and with SC logits = (no-SC logits) / 0.7;
  * the canvas committed through the encoder, then K/V again and decoder logits for a second canvas.
The reference runs in float32 on the bf16 weights (upcast exactly), so an f32 engine must match to round-off.
Norm weights, router scales, per-expert scales and layer scalars are randomized (encoder != decoder scalars), since
all-ones hide w-vs-(1+w) and missing-scale bugs. Logits of vocabularies > 4096 are stored as a column subset plus
full-row argmax / max / logsumexp (the full 262144-wide rows would not fit the fixture budget).
"""
import argparse
import json
import math
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

S, F = "sliding_attention", "full_attention"
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=8)
CONFIGS = {
    # prompt (20) and canvas (16) both longer than the sliding window (8); GQA 2 (sliding) and 4 (full)
    "tiny-a": dict(seed=11, canvas=16, prompt_len=20, legacy_config=False,
                   text=dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                             num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                             num_global_key_value_heads=1, head_dim=16, global_head_dim=32, num_experts=8,
                             top_k_experts=2, sliding_window=8, layer_types=[S] * 5 + [F])),
    # interleaved layer types, awkward vocab, top-4 of 16 experts; config.json rewritten to the pre-5.17 form
    # (global_head_dim / num_global_key_value_heads / final_logit_softcapping) to cover both parsers
    "tiny-b": dict(seed=22, canvas=32, prompt_len=40, legacy_config=True,
                   text=dict(vocab_size=1000, hidden_size=96, intermediate_size=80, moe_intermediate_size=24,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                             num_global_key_value_heads=2, head_dim=32, global_head_dim=64, num_experts=16,
                             top_k_experts=4, sliding_window=12, layer_types=[S, F, S, F])),
    # the real vocabulary (262144) with a small hidden size; the bundled default model of the README demo
    "tiny-v": dict(seed=33, canvas=32, prompt_len=24, legacy_config=False,
                   text=dict(vocab_size=262144, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                             num_global_key_value_heads=1, head_dim=16, global_head_dim=32, num_experts=8,
                             top_k_experts=2, sliding_window=16, layer_types=[S] * 5 + [F])),
    # generation-parity model: the self-conditioning MLP's output is damped (x0.02) so the SC feedback loop is
    # contractive. On the undamped random models a 1e-7 relative change of the SC logits changes the whole
    # multi-step trajectory (measured), so float round-off differences between any two engines (HF vs ours) make
    # exact multi-step token parity impossible there; on this one, 1e-6 perturbations change nothing.
    "tiny-g": dict(seed=44, canvas=32, prompt_len=28, legacy_config=False, sc_down_scale=0.02,
                   text=dict(vocab_size=700, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             num_global_key_value_heads=1, head_dim=16, global_head_dim=32, num_experts=8,
                             top_k_experts=2, sliding_window=12, layer_types=[S, S, S, F])),
}
SC_DIVISOR = 0.7
FULL_LOGITS_MAX_VOCAB = 4096
SUBSET_STRIDE = 97  # column subset for large vocabularies: every 97th id plus each row's top-8


def randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if name.endswith(("norm.weight", ".scale", "per_expert_scale")):
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)  # logits of O(sqrt(H)): exercises the softcap, avoids argmax near-ties
            elif p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)  # encoder and decoder scalars get different values on purpose


def cache_kv(cache, layer):
    if hasattr(cache, "layers"):
        lay = cache.layers[layer]
        k, v = lay.keys, lay.values
    else:
        k, v = cache.key_cache[layer], cache.value_cache[layer]
    # [1, nkv, n, D] -> [n, nkv, D]
    return k[0].transpose(0, 1).contiguous().float(), v[0].transpose(0, 1).contiguous().float()


def logits_tensors(prefix, logits, out):
    """logits [L, V] f32 -> tensors in `out` (full, or a column subset plus full-row statistics)."""
    L, V = logits.shape
    out[prefix + ".argmax"] = logits.argmax(-1).to(torch.int64)
    out[prefix + ".max"] = logits.max(-1).values.contiguous()
    out[prefix + ".logsumexp"] = torch.logsumexp(logits.double(), -1).float().contiguous()
    if V <= FULL_LOGITS_MAX_VOCAB:
        out[prefix + ".full"] = logits.contiguous()
        return
    cols = set(range(0, V, SUBSET_STRIDE))
    cols.update(logits.topk(8, -1).indices.flatten().tolist())
    cols = torch.tensor(sorted(cols), dtype=torch.int64)
    out[prefix + ".cols"] = cols
    out[prefix + ".vals"] = logits[:, cols].contiguous()


def rewrite_legacy_config(path, text_cfg):
    with open(path) as f:
        cfg = json.load(f)
    tc = cfg["text_config"]
    tc.pop("per_layer_config", None)
    tc["global_head_dim"] = text_cfg["global_head_dim"]
    tc["num_global_key_value_heads"] = text_cfg["num_global_key_value_heads"]
    tc["final_logit_softcapping"] = 30.0
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def build(name, spec, out_root):
    torch.manual_seed(spec["seed"])
    L, P = spec["canvas"], spec["prompt_len"]
    tc = spec["text"]
    V, nl = tc["vocab_size"], tc["num_hidden_layers"]
    cfg = DiffusionGemmaConfig(text_config=dict(tc, final_logit_softcapping=30.0,
                                                use_bidirectional_attention="vision"),
                               vision_config=VISION, canvas_length=L)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    randomize(model)
    if "sc_down_scale" in spec:
        with torch.no_grad():
            model.model.decoder.self_conditioning.down_proj.weight.mul_(spec["sc_down_scale"])
    d = os.path.join(out_root, name)
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d)
    if spec["legacy_config"]:
        rewrite_legacy_config(os.path.join(d, "config.json"), tc)

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(d, dtype=torch.float32).eval()
    sd = ref.state_dict()
    enc = sd["model.encoder.language_model.layers.0.layer_scalar"].item()
    dec = sd["model.decoder.layers.0.layer_scalar"].item()
    assert enc != dec, "encoder and decoder layer scalars must differ"
    assert all(t.shape[0] == (tc["num_global_key_value_heads"] * tc["global_head_dim"])
               for k, t in sd.items() if k.endswith("5.self_attn.k_proj.weight")), "global kv heads lost on reload"

    g = torch.Generator().manual_seed(spec["seed"] + 1)
    prompt = torch.randint(3, V, (1, P), generator=g)
    prompt[0, 0] = 2
    c1 = torch.randint(0, V, (L,), generator=g)
    c2 = torch.randint(0, V, (L,), generator=g)
    tensors = {}
    with torch.no_grad():
        out = ref(input_ids=prompt, decoder_input_ids=c1[None])
        cache = out.past_key_values
        for l in range(nl):
            k, v = cache_kv(cache, l)
            tensors[f"prefill.k.{l}"], tensors[f"prefill.v.{l}"] = k, v
        nosc = out.logits[0].float()
        logits_tensors("logits.nosc", nosc, tensors)
        sc = ref(past_key_values=cache, decoder_input_ids=c1[None],
                 self_conditioning_logits=(nosc / SC_DIVISOR)[None]).logits[0].float()
        logits_tensors("logits.sc", sc, tensors)
        ref.model.encoder(input_ids=c1[None], past_key_values=cache, position_ids=torch.arange(P, P + L)[None])
        for l in range(nl):
            k, v = cache_kv(cache, l)
            tensors[f"commit.k.{l}"], tensors[f"commit.v.{l}"] = k, v
        commit = ref(past_key_values=cache, decoder_input_ids=c2[None]).logits[0].float()
        logits_tensors("logits.commit", commit, tensors)

    rd = os.path.join(d, "reference")
    os.makedirs(rd, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(rd, "ref.safetensors"))
    case = dict(name=name, prompt_ids=prompt[0].tolist(), canvas1=c1.tolist(), canvas2=c2.tolist(),
                sc_divisor=SC_DIVISOR, transformers=transformers.__version__, torch=torch.__version__,
                note="reference in float32 on the bf16 checkpoint; see tools/reference/make_fixtures.py")
    with open(os.path.join(rd, "case.json"), "w") as f:
        json.dump(case, f, indent=1)
    size = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(d) for fn in fns)
    print(f"{name}: V={V} L={L} P={P} layers={nl} -> {d} ({size / 1e6:.1f} MB); "
          f"nosc argmax[:8]={tensors['logits.nosc.argmax'][:8].tolist()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--only", nargs="*", help="subset of: " + " ".join(CONFIGS))
    args = ap.parse_args()
    print("transformers", transformers.__version__, "torch", torch.__version__)
    for name, spec in CONFIGS.items():
        if not args.only or name in args.only:
            build(name, spec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
