#!/usr/bin/env python3
"""Builds a 2-layer DiffusionGemma checkpoint with the FULL 26B-A4B layer shapes plus HF transformers reference
outputs (bf16 on the GPU, the way users run it, and float32), for the CUDA-vs-HF parity check of issue 5.

Runs on the GPU machine (transformers 5.17 + torch with CUDA, no network), ~1-2 minutes, ~5 GB of disk:
    HF_HUB_OFFLINE=1 python3 tools/reference/make_fullshape_fixture.py --out /tmp/fullshape
Never commit the output. Exit status 1 (and "FAIL" lines) when a structural self-check fails; "WARN" lines say the
random model is less discriminating than designed (logit scale, near-ties, SC effect, HF bf16 vs f32 already
missing the parity bar); the files are written either way.

Model: hidden 2816, 16 heads, sliding layers hd 256 / 8 kv heads (theta 1e4), full layers hd 512 / 2 kv heads
(proportional RoPE 0.25, theta 1e6, V = raw k_proj), 128 experts top-8 width 704, dense MLP 2112, vocab 262144,
window 1024, layer_types = [sliding_attention, full_attention], softcap 30, canvas 256. Random weights, chosen so
every branch matters and activations/logits are O(1)-O(10) instead of degenerate (see randomize()):
  * Linear / expert weights N(0, 1/fan_in); embedding N(0, 1/hidden) -> logits ~N(0, 1) before the softcap, so
    softmax(logits / 0.8) is spread (SC soft-embedding really mixes rows) while the input token, carried by the
    residual stream through the tied embedding, usually wins the argmax by several logits (decisive in bf16);
  * q_norm / k_norm weights U(0.2, 0.5): attention scores (no 1/sqrt(d)) with std ~2-3, not one-hot;
  * router.proj N(0, 1.5^2): router logits std ~1.5, top-8 not a near-uniform coin toss;
  * post_attention_layernorm / post_feedforward_layernorm U(1.5, 3): the branches dominate the residual stream;
  * all other norms, router.scale, per_expert_scale and the encoder layer scalars U(0.5, 1.5);
  * decoder layer scalars pinned to (0.6, 1.3): the layer-0 scalar sets how much of the input token survives in
    the final residual (z-score of its logit ~ 53 * share ~ 8 here); a random draw could make it ~13 (SC softmax
    one-hot) or ~7 (argmax near-ties). Still != 1 and != the encoder's, so scalar mix-ups stay visible.
Saved with save_pretrained in bf16 (one model.safetensors, ~4.9 GB: 2 x 0.76 B expert params + 0.74 B embedding)
with config.json (5.17 format: per_layer_config) and generation_config.json.

Reference case (same for both precisions; ids in case.json):
  1. prompt (P = --prompt-len, default 600, random ids, id 2 first) prefilled through the encoder;
  2. decoder logits for canvas1 (256 random ids) without SC                                     -> case "nosc";
  3. decoder logits for canvas1 with self_conditioning_logits = sc_input                        -> case "sc";
     sc_input = bf16( logits_nosc(bf16 run) / 0.8 )  -- exactly what generate feeds back after a step at T = 0.8;
     the f32 run is fed the SAME sc_input (upcast exactly), so both references share one input;
  4. canvas1 committed through the encoder at positions [P, P+256), then decoder logits for canvas2 without SC
                                                                                                -> case "commit".
HF runs: from_pretrained(dir, dtype=bfloat16 | float32, attn_implementation="sdpa") moved to the GPU; TF32 is off
for the f32 run. Differences of definition between the two runs: embed scale bf16(sqrt(2816)) = 53.0 (bf16 run) vs
53.0660 (f32 run), and the bf16 run rounds every activation to bf16 (lm_head output included, before the f32 softcap).

<out>/reference/ref.safetensors (read with dg::SafetensorsFile; R = "bf16" or "f32" = precision of the HF run,
C = "nosc" | "sc" | "commit", L = 256, V = 262144; logits are softcapped, NOT tempered):
  R.logits.C.argmax     I64 [L]      full-row argmax (first index among equal maxima)
  R.logits.C.max        F32 [L]      full-row max
  R.logits.C.logsumexp  F32 [L]      full-row log-sum-exp (computed in float64)
  R.logits.C.margin     F32 [L]      full-row top-1 minus top-2 value (small = near-tie: argmax not meaningful)
  R.logits.C.cols       I64 [Ncol]   sorted column ids: every 61st id, plus the top-8 ids of every row of BOTH runs
                                     (so bf16.logits.C.cols == f32.logits.C.cols)
  R.logits.C.vals       F32 [L, Ncol] logits[row, cols[j]]
  R.prefill.k.{l}, R.prefill.v.{l}   F32 [n, nkv, D]  cache after the prompt (post-norm, post-RoPE K; normed V)
  R.commit.k.{l},  R.commit.v.{l}    F32 [n, nkv, D]  cache after committing canvas1 (n = P + 256)
     (l = 0 sliding: nkv 8, D 256; l = 1 full: nkv 2, D 512; HF keeps the last W-1 = 1023 positions on sliding
      layers; rows are positions [kv_len - n, kv_len))
  sc_input              BF16 [L, V]  the SC logits of case "sc" (feed them as DenoiseRequest::sc_logits, External)
<out>/reference/case.json: name, prompt_ids, canvas1, canvas2 (int lists), prompt_len, canvas_length, sc_divisor (0.8),
  seed, versions, device, attn/experts implementations, init scales, and "stats": per run and case the logits
  std / argmax==canvas-token fraction / near-tie count / SC entropy, hidden-state RMS per layer, and the bf16-vs-f32
  agreement (cosine over cols, argmax agreement) = the floor any bf16 engine can expect against the f32 reference.

Suggested C++ check (issue 5): run prefill(prompt) / denoise(canvas1, None) / denoise(canvas1, External sc_input) /
prefill(canvas1) / denoise(canvas2, None) with want_logits; per case and per reference R: cosine over the stored
columns of all rows (flattened [L, Ncol], float64) >= 0.999, and argmax agreement >= 99% of the rows (optionally
counting only rows with R...margin >= 0.05, printing how many were excluded).
"""
import argparse
import json
import math
import os
import shutil
import sys
import time

import torch
import transformers
from safetensors.torch import save_file
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

S, F = "sliding_attention", "full_attention"
H = 2816
TEXT = dict(vocab_size=262144, hidden_size=H, intermediate_size=2112, moe_intermediate_size=704, num_hidden_layers=2,
            num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256,
            global_head_dim=512, num_experts=128, top_k_experts=8, sliding_window=1024, layer_types=[S, F],
            max_position_embeddings=262144, final_logit_softcapping=30.0, use_bidirectional_attention="vision")
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=8)  # the class needs a vision tower; tiny, unused
L, V = 256, TEXT["vocab_size"]
SC_DIVISOR = 0.8
SUBSET_STRIDE = 61
NEAR_TIE = 0.05  # logits units; rows whose top-1 - top-2 is below this are counted as near-ties
SCALES = dict(qk_norm=(0.2, 0.5), post_branch_norm=(1.5, 3.0), other_norms_scalars=(0.5, 1.5),
              decoder_layer_scalars=(0.6, 1.3),
              embed_std=1 / math.sqrt(H), router_proj_std=1.5, linear_std="1/sqrt(fan_in)")
T0 = time.time()
FAILS, WARNS = [], []


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def check(ok, what, warn_only=False):
    """FAIL = the fixture is wrong; WARN = the random model is less discriminating than designed (still usable)."""
    print(("ok:   " if ok else "WARN: " if warn_only else "FAIL: ") + what, flush=True)
    if not ok:
        (WARNS if warn_only else FAILS).append(what)


def randomize(model):
    """Why each scale: see the module docstring. All draws on the GPU from torch.manual_seed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(*SCALES["qk_norm"])
            elif name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                p.uniform_(*SCALES["post_branch_norm"])
            elif name.endswith(("norm.weight", ".scale", "per_expert_scale")):
                p.uniform_(*SCALES["other_norms_scalars"])
            elif "embed_tokens" in name or name == "lm_head.weight":  # tied: one tensor, whichever name it has
                p.normal_(0.0, SCALES["embed_std"])
            elif name.endswith("router.proj.weight"):
                p.normal_(0.0, SCALES["router_proj_std"])
            elif p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                if name.startswith("model.decoder.layers."):
                    b.fill_(SCALES["decoder_layer_scalars"][int(name.split(".")[3])])
                else:
                    b.uniform_(*SCALES["other_norms_scalars"])


def build_checkpoint(out, seed):
    cfg = DiffusionGemmaConfig(text_config=TEXT, vision_config=VISION, canvas_length=L)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)  # init in bf16 on the GPU (fast), then save from the CPU
    try:
        with torch.device("cuda"):
            model = DiffusionGemmaForBlockDiffusion(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    randomize(model)
    shutil.rmtree(out, ignore_errors=True)
    model.to("cpu").save_pretrained(out, max_shard_size="50GB")
    del model
    torch.cuda.empty_cache()


def load(out, dtype):
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(out, dtype=dtype, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    sd = model.state_dict()
    types = model.config.text_config.layer_types
    check(types == [S, F], f"{dtype} layer_types = {types}")
    check(tuple(sd["model.decoder.layers.1.self_attn.k_proj.weight"].shape) == (2 * 512, H)
          and "model.decoder.layers.1.self_attn.v_proj.weight" not in sd
          and tuple(sd["model.decoder.layers.0.self_attn.v_proj.weight"].shape) == (8 * 256, H),
          f"{dtype} attention shapes (full layer: 2 kv heads x 512, no v_proj) survived the reload")
    check(model.lm_head.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr(),
          f"{dtype} lm_head tied to the embedding")
    enc = sd["model.encoder.language_model.layers.0.layer_scalar"].item()
    dec = sd["model.decoder.layers.0.layer_scalar"].item()
    check(enc != dec, f"{dtype} encoder ({enc:.4f}) and decoder ({dec:.4f}) layer scalars differ")
    return model


def cache_kv(cache, layer):
    lay = cache.layers[layer]
    # [1, nkv, n, D] -> [n, nkv, D] f32 (exact for bf16 values)
    k, v = lay.keys[0].transpose(0, 1), lay.values[0].transpose(0, 1)
    return k.float().cpu().contiguous(), v.float().cpu().contiguous()


def run_hf(model, prompt, c1, c2, sc_input, tensors, prefix, stats):
    """The reference case on one loaded model; returns {case: [L, V] f32 logits on the GPU}."""
    dev = "cuda"
    P = prompt.shape[0]
    rms = {}
    hooks = []
    for side, layers in (("encoder", model.model.encoder.language_model.layers),
                         ("decoder", model.model.decoder.layers)):
        for i, lay in enumerate(layers):
            def hook(mod, inp, out, key=f"{side}.{i}"):
                h = out[0] if isinstance(out, tuple) else out
                rms.setdefault(key, round(h.float().pow(2).mean().sqrt().item(), 3))  # first call only
            hooks.append(lay.register_forward_hook(hook))
    logits = {}
    with torch.no_grad():
        out = model(input_ids=prompt[None].to(dev), decoder_input_ids=c1[None].to(dev))
        for h in hooks:
            h.remove()
        cache = out.past_key_values
        for l in range(2):
            tensors[f"{prefix}.prefill.k.{l}"], tensors[f"{prefix}.prefill.v.{l}"] = cache_kv(cache, l)
        logits["nosc"] = out.logits[0].float()
        if sc_input is None:  # bf16 run: make the SC input from its own no-SC logits, as generate would
            sc_input = (logits["nosc"] / SC_DIVISOR).to(torch.bfloat16)
        logits["sc"] = model(past_key_values=cache, decoder_input_ids=c1[None].to(dev),
                             self_conditioning_logits=sc_input[None].to(dev, model.dtype)).logits[0].float()
        model.model.encoder(input_ids=c1[None].to(dev), past_key_values=cache,
                            position_ids=torch.arange(P, P + L, device=dev)[None])
        n = cache.get_seq_length()
        check(n == P + L, f"{prefix} cache holds {n} tokens after the commit (P + L = {P + L})")
        for l in range(2):
            tensors[f"{prefix}.commit.k.{l}"], tensors[f"{prefix}.commit.v.{l}"] = cache_kv(cache, l)
        logits["commit"] = model(past_key_values=cache, decoder_input_ids=c2[None].to(dev)).logits[0].float()
    stats[prefix] = dict(hidden_rms=rms)
    for case, x in logits.items():
        check(bool(torch.isfinite(x).all()), f"{prefix} {case} logits finite")
    return logits, sc_input


def row_stats(x, canvas):
    top = x.topk(2, -1).values
    margin = top[:, 0] - top[:, 1]
    p = torch.softmax(x / SC_DIVISOR, -1)
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return margin, dict(logit_mean=round(x.mean().item(), 3), logit_std=round(x.std().item(), 3),
                        logit_max_mean=round(top[:, 0].mean().item(), 3),
                        argmax_is_canvas_token=round((x.argmax(-1).cpu() == canvas).float().mean().item(), 3),
                        near_tie_rows=int((margin < NEAR_TIE).sum()), margin_min=round(margin.min().item(), 4),
                        sc_softmax_entropy_mean=round(ent.mean().item(), 3),
                        sc_softmax_top1_mean=round(p.max(-1).values.mean().item(), 4))


def store_logits(prefix, x, cols, tensors):
    margin, _ = row_stats(x, torch.zeros(L, dtype=torch.long))
    tensors[prefix + ".argmax"] = x.argmax(-1).to(torch.int64).cpu()
    tensors[prefix + ".max"] = x.max(-1).values.cpu()
    tensors[prefix + ".logsumexp"] = torch.logsumexp(x.double(), -1).float().cpu()
    tensors[prefix + ".margin"] = margin.cpu()
    tensors[prefix + ".cols"] = cols.cpu()
    tensors[prefix + ".vals"] = x[:, cols].cpu().contiguous()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (replaced); ~5 GB, never commit it")
    ap.add_argument("--prompt-len", type=int, default=600,
                    help="> 1023 also exercises the sliding window (ring) at full shape, e.g. 1100")
    ap.add_argument("--seed", type=int, default=2816)
    ap.add_argument("--skip-f32", action="store_true", help="only the bf16 reference")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("FAIL: no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # the f32 reference must be real f32 (bf16 runs are unaffected)
    torch.backends.cudnn.allow_tf32 = False
    dev_name = torch.cuda.get_device_name(0)
    log("transformers", transformers.__version__, "torch", torch.__version__, "device", dev_name)

    build_checkpoint(args.out, args.seed)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(args.out) for f in fs)
    log(f"checkpoint saved to {args.out}: {size / 1e9:.2f} GB {sorted(os.listdir(args.out))}")

    P = args.prompt_len
    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(3, V, (P,), generator=g)
    prompt[0] = 2
    c1 = torch.randint(0, V, (L,), generator=g)
    c2 = torch.randint(0, V, (L,), generator=g)

    tensors, stats, logits, impl = {}, {}, {}, {}
    sc_input = None
    for prefix, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        if prefix == "f32" and args.skip_f32:
            continue
        model = load(args.out, dtype)
        try:
            impl[prefix] = dict(attn=model.config.text_config._attn_implementation,
                                experts=str(model.get_experts_implementation()))
        except Exception as e:  # informative only
            impl[prefix] = dict(attn=model.config.text_config._attn_implementation, experts=f"unknown ({e!r})")
        logits[prefix], sc_input = run_hf(model, prompt, c1, c2, sc_input, tensors, prefix, stats)
        del model
        torch.cuda.empty_cache()
        log(f"{prefix} reference done ({impl[prefix]}); hidden RMS {stats[prefix]['hidden_rms']}")
    tensors["sc_input"] = sc_input.cpu().contiguous()

    canvas_of = dict(nosc=c1, sc=c1, commit=c2)
    for case in ("nosc", "sc", "commit"):
        cols = set(range(0, V, SUBSET_STRIDE))
        for prefix in logits:
            cols.update(logits[prefix][case].topk(8, -1).indices.flatten().tolist())
        cols = torch.tensor(sorted(cols), dtype=torch.int64, device="cuda")
        for prefix in logits:
            x = logits[prefix][case]
            store_logits(f"{prefix}.logits.{case}", x, cols, tensors)
            _, st = row_stats(x, canvas_of[case])
            stats[prefix][case] = st
            log(f"{prefix} {case}: {st}")
            check(0.3 < st["logit_std"] < 10 and st["logit_max_mean"] < 30,
                  f"{prefix} {case} logits O(1)-O(10) (std {st['logit_std']}, mean row max {st['logit_max_mean']})",
                  warn_only=True)
            check(st["near_tie_rows"] <= L // 20, f"{prefix} {case}: {st['near_tie_rows']} rows with top-1 - top-2 < "
                  f"{NEAR_TIE} (<= 5% wanted, so argmax agreement is meaningful)", warn_only=True)
        if "f32" in logits:  # what a perfect bf16 engine can expect against each reference
            a, b = logits["bf16"][case][:, cols].double(), logits["f32"][case][:, cols].double()
            cos = (a * b).sum() / (a.norm() * b.norm())
            agree = int((logits["bf16"][case].argmax(-1) == logits["f32"][case].argmax(-1)).sum())
            stats.setdefault("bf16_vs_f32", {})[case] = dict(cosine=round(cos.item(), 6), argmax_agree=agree,
                                                             rows=L)
            log(f"HF bf16 vs HF f32, {case}: cosine over cols {cos.item():.6f}, argmax agreement {agree}/{L}")
            check(cos.item() >= 0.999 and agree >= math.ceil(0.99 * L),
                  f"HF bf16 vs f32 {case} meets the bar itself (cosine >= 0.999, argmax >= 99%)", warn_only=True)
    for prefix in logits:
        sc_moved = (logits[prefix]["sc"] - logits[prefix]["nosc"]).norm() / logits[prefix]["nosc"].norm()
        stats[prefix]["sc_relative_change"] = round(sc_moved.item(), 4)
        check(sc_moved.item() > 0.05, f"{prefix}: self-conditioning changes the logits "
              f"(relative {sc_moved.item():.3f})", warn_only=True)

    rd = os.path.join(args.out, "reference")
    os.makedirs(rd, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(rd, "ref.safetensors"))
    case = dict(name="fullshape-2layer", prompt_ids=prompt.tolist(), canvas1=c1.tolist(), canvas2=c2.tolist(),
                prompt_len=P, canvas_length=L, sc_divisor=SC_DIVISOR, seed=args.seed, subset_stride=SUBSET_STRIDE,
                near_tie=NEAR_TIE, scales=SCALES, implementations=impl, stats=stats, warnings=WARNS,
                transformers=transformers.__version__, torch=torch.__version__, device=dev_name,
                note="see tools/reference/make_fullshape_fixture.py for the format")
    with open(os.path.join(rd, "case.json"), "w") as f:
        json.dump(case, f, indent=1)
    ref_mb = os.path.getsize(os.path.join(rd, "ref.safetensors")) / 1e6
    print(f"\nfull-shape fixture: {args.out} (checkpoint {size / 1e9:.2f} GB, reference {ref_mb:.0f} MB), "
          f"P={P} L={L}, runs {list(logits)}, {time.time() - T0:.0f} s")
    for case_name, v in stats.get("bf16_vs_f32", {}).items():
        print(f"  HF bf16 vs f32 {case_name:6s}: cosine {v['cosine']:.6f}  argmax {v['argmax_agree']}/{v['rows']}")
    for w in WARNS:
        print("WARN:", w)
    for f in FAILS:
        print("FAIL:", f)
    print("RESULT", "FAIL" if FAILS else "PASS")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
