#!/usr/bin/env python3
"""Times HF transformers on the full-size DiffusionGemma (26B-A4B shapes, random bf16 weights) on one GPU.

Runs on the GPU machine (transformers 5.17 + torch with CUDA, no network):
    HF_HUB_OFFLINE=1 python3 tools/reference/bench_hf.py --json hf_bench.json            # ~5-6 min (3 min compile)
    HF_HUB_OFFLINE=1 python3 tools/reference/bench_hf.py --skip-compile --json hf.json   # ~1.5 min
    HF_HUB_OFFLINE=1 python3 tools/reference/bench_hf.py --quick                          # ~1 min: eager 4K step only

What is timed (CUDA events, after warm-up, median of the repeats; the model is built directly on the GPU in bf16 with
HF's random init, attn_implementation "sdpa", the HF default experts implementation unless --experts is given):
  * eager denoise step: one decoder forward on a 256-token canvas WITH self-conditioning logits (bf16 [1, 256, V], as
    generate passes them from the 2nd step on) over an encoder cache of kv = 512, 4096 and 32768 tokens (32768 is
    skipped with a note when it runs out of memory). The sampler (softmax/entropy/multinomial) is not included here.
    With it, the GPU's busy time in one such step (the union of its GPU activity intervals, torch.profiler): the rest
    of the step is the GPU waiting for the host's launches, which is why the eager step varies between hosts.
  * eager prefill of 4096 tokens (one encoder call into a fresh DynamicCache): ms and tokens/s.
  * eager generate (DynamicCache): 4096-token prompt + 256 new tokens at exactly 16 denoising steps.
  * static cache + torch.compile (generate(cache_implementation="static") compiles the decoder, sampler and stopping
    criteria with mode="reduce-overhead"; the prompt prefill itself stays eager): the same 4K + 256 @ 16 steps call,
    after two warm-up calls (the first one compiles, ~3 min; the second records the CUDA graphs), and the same call at
    1 step. ms/step = (t16 - t1) / 15 (prefill excluded, sampler included); all-in = t16 / 16.
Exactly 16 steps per canvas: early stop needs "argmax stable AND mean entropy < confidence_threshold"; we pass
confidence_threshold=1e-9 (it must be a float > 0) and random weights give ~12 nats, so every canvas runs all steps.
The number of decoder forwards is checked (eager: a forward hook; compiled: from tokens_per_forward).
Output: a table printed last, and with --json the same numbers as JSON (rewritten after every phase, so a run cut
short still leaves what it measured). Exit status 1 when a check failed (FAIL lines above the table). Note:
tools/gpu/run_all.sh wraps this in `timeout ${HF_TIMEOUT:-300}`; the full run needs HF_TIMEOUT=420.
"""
import argparse
import json
import statistics
import sys
import time
import traceback

import torch
import transformers
from transformers import (DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig,
                          DynamicCache, Gemma4VisionConfig)

V, L = 262144, 256
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def build_model(experts):
    # The 26B-A4B text config (model-reference §1.1); tiny vision tower (the class requires one; text-only here).
    tc = DiffusionGemmaTextConfig(
        vocab_size=V, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2, sliding_window=1024,
        num_experts=128, top_k_experts=8, moe_intermediate_size=704, max_position_embeddings=262144,
        final_logit_softcapping=30.0, use_bidirectional_attention="vision")
    vc = Gemma4VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=32)
    cfg = DiffusionGemmaConfig(text_config=tc, vision_config=vc, canvas_length=L)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # init straight into bf16 on the GPU: no 100 GB f32 detour
    try:
        with torch.device("cuda"):
            model = DiffusionGemmaForBlockDiffusion(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.eval()
    if model.config.text_config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    attn = model.config.text_config._attn_implementation
    if attn != "sdpa":
        sys.exit(f"FAIL: attention implementation is {attn!r}, not 'sdpa'")
    if experts:
        model.set_experts_implementation(experts)
    try:
        experts_impl = model.get_experts_implementation()
    except Exception as e:  # informative only
        experts_impl = f"unknown ({e!r})"
    return model, attn, experts_impl


def time_ms(fn, warmup, repeats):
    """Median (and all samples) of CUDA-event times of fn() in ms, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples), [round(s, 2) for s in samples]


def gpu_busy_ms(fn, repeats=3):
    """Per call of fn: the union of its GPU activity intervals (kernels, memcpy, memset) from torch.profiler, in ms.

    Set against the CUDA-event time, this says how much of an eager step the GPU works and how much it waits for the
    host to launch the next kernel (HF's eager step swings 70-150 ms between hosts with the GPU work unchanged).
    Returns None with a log line if the profiler is unavailable, so the timing itself never depends on it."""
    try:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()  # fn is already warm: step_ms times it first
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                fn()
            torch.cuda.synchronize()
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start)
        busy_us, covered_until = 0.0, float("-inf")
        for start, end in spans:  # sorted by start: each span adds only what lies past the spans before it
            busy_us += max(0.0, end - max(start, covered_until))
            covered_until = max(covered_until, end)
        return round(busy_us / 1e3 / repeats, 2) if spans else None
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        log("NOTE: GPU busy time not measured:", repr(e)[:200])
        return None


def prefill(model, ids, chunk):
    """Encoder pass over ids into a fresh DynamicCache, `chunk` tokens per call (positions given explicitly)."""
    cache = DynamicCache(config=model.config.text_config)
    n = ids.shape[1]
    with torch.no_grad():
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            pos = torch.arange(s, e, device=ids.device)[None]
            model.model.encoder(input_ids=ids[:, s:e], past_key_values=cache, position_ids=pos)
    return cache


def step_ms(model, kv, args, gen):
    """Median ms of one decoder forward (canvas 256, with SC logits) over a kv-token encoder cache."""
    ids = torch.randint(3, V, (1, kv), device="cuda", generator=gen)
    cache = prefill(model, ids, 4096)
    assert cache.get_seq_length() == kv, (cache.get_seq_length(), kv)
    canvas = torch.randint(0, V, (1, L), device="cuda", generator=gen)
    sc = torch.randn(1, L, V, device="cuda", dtype=torch.bfloat16, generator=gen)
    pos = torch.arange(kv, kv + L, device="cuda")[None]

    def step():
        with torch.no_grad():
            model(decoder_input_ids=canvas, past_key_values=cache, self_conditioning_logits=sc,
                  decoder_position_ids=pos)

    med, samples = time_ms(step, args.warmup, args.repeats)
    busy = gpu_busy_ms(step)
    # the decoder must read the cache without appending to it, or later steps would time a longer context
    assert cache.get_seq_length() == kv, f"decoder changed the cache length: {cache.get_seq_length()} != {kv}"
    del cache, sc
    torch.cuda.empty_cache()
    return med, samples, busy


GEN_KW = dict(max_new_tokens=L, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=1e-9,
              eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)


def forwards_from(out, prompt_len):
    """Decoder forwards per generate call, from tokens_per_forward = valid new tokens / forwards (pad id 0)."""
    new = out.sequences[0, prompt_len:]
    valid = int((new != 0).sum())
    return round(valid / float(out.tokens_per_forward[0]))


def compiled_part(model, ids4k, args, res):
    """generate(cache_implementation="static"): HF compiles decoder/sampler/stopping with mode="reduce-overhead"."""
    kw = dict(GEN_KW, cache_implementation="static")
    comp = res["compiled"] = dict(warmup_s=[])
    for i in range(2):  # 1st call compiles (~3 min), 2nd records the CUDA graphs of reduce-overhead
        torch.cuda.synchronize()
        t = time.time()
        out = model.generate(ids4k, max_denoising_steps=16, **kw)
        torch.cuda.synchronize()
        comp["warmup_s"].append(round(time.time() - t, 1))
        log(f"compiled warm-up {i}: {comp['warmup_s'][-1]} s")
    comp["decoder_forwards"] = nfw = forwards_from(out, ids4k.shape[1])
    if nfw != 16:
        res["failures"].append(f"compiled generate ran {nfw} decoder forwards, expected 16")
    model.generate(ids4k, max_denoising_steps=1, **kw)  # the 1-step call reuses the same graphs; warm it anyway
    t16, s16 = time_ms(lambda: model.generate(ids4k, max_denoising_steps=16, **kw), 0, args.gen_repeats)
    t1, s1 = time_ms(lambda: model.generate(ids4k, max_denoising_steps=1, **kw), 0, args.gen_repeats)
    comp.update(generate_4k_256_16steps_ms=round(t16, 1), samples_16_ms=s16,
                generate_4k_256_1step_ms=round(t1, 1), samples_1_ms=s1,
                ms_per_step=round((t16 - t1) / 15, 2), ms_per_step_all_in=round(t16 / 16, 2))
    log(f"compiled generate 4K+256: 16 steps {t16:.0f} ms {s16}, 1 step {t1:.0f} ms {s1} -> "
        f"{(t16 - t1) / 15:.1f} ms/step (prefill excluded), {t16 / 16:.1f} ms/step all-in")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="only the eager denoise step at kv 4096")
    ap.add_argument("--skip-compile", action="store_true", help="skip the static-cache + torch.compile part")
    ap.add_argument("--skip-32k", action="store_true", help="skip the kv 32768 step")
    ap.add_argument("--experts", help="experts implementation (eager, grouped_mm, batched_mm); default: HF's")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats of a denoise step (median reported)")
    ap.add_argument("--gen-repeats", type=int, default=3, help="timed repeats of a generate call")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("FAIL: no CUDA device")
    dev = torch.cuda.get_device_name(0)
    log("transformers", transformers.__version__, "torch", torch.__version__, "device", dev)

    model, attn, experts_impl = build_model(args.experts)
    torch.cuda.synchronize()
    log(f"model built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB; attn={attn} experts={experts_impl}")
    res = dict(tool="tools/reference/bench_hf.py", transformers=transformers.__version__, torch=torch.__version__,
               device=dev, dtype="bfloat16", attn_implementation=attn, experts_implementation=str(experts_impl),
               canvas=L, notes=[], failures=[], eager={}, compiled=None)
    eager = res["eager"]
    gen = torch.Generator(device="cuda").manual_seed(1)

    def save():  # after every phase, so a run cut short by a timeout still leaves what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)

    # --- eager denoise steps ---
    eager["step_ms"], eager["step_samples_ms"], eager["step_gpu_busy_ms"] = {}, {}, {}
    kvs = [4096] if args.quick else [512, 4096] + ([] if args.skip_32k else [32768])
    for kv in kvs:
        try:
            med, samples, busy = step_ms(model, kv, args, gen)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            note = f"kv {kv} step skipped: out of memory ({str(e).splitlines()[0][:160]})"
            log("NOTE", note)
            res["notes"].append(note)
            eager["step_ms"][str(kv)] = None
            continue
        eager["step_ms"][str(kv)], eager["step_samples_ms"][str(kv)] = round(med, 2), samples
        eager["step_gpu_busy_ms"][str(kv)] = busy
        log(f"eager denoise step kv {kv}: {med:.1f} ms  {samples}; GPU busy {busy} ms of it")
        save()

    if not args.quick:
        # --- eager prefill 4K ---
        ids4k = torch.randint(3, V, (1, 4096), device="cuda", generator=gen)
        med, samples = time_ms(lambda: prefill(model, ids4k, 4096), 1, args.gen_repeats)
        eager["prefill_4k_ms"], eager["prefill_4k_tok_s"] = round(med, 2), round(4096 / (med / 1e3))
        log(f"eager prefill 4096: {med:.1f} ms = {4096 / (med / 1e3):.0f} tok/s  {samples}")
        save()
        torch.cuda.empty_cache()

        # --- eager generate, 4K prompt + 256 tokens @ 16 steps ---
        calls = [0]
        hook = model.model.decoder.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
        out = model.generate(ids4k, max_denoising_steps=16, **GEN_KW)
        hook.remove()
        if calls[0] != 16:
            res["failures"].append(f"eager generate ran {calls[0]} decoder forwards, expected 16")
        med, samples = time_ms(lambda: model.generate(ids4k, max_denoising_steps=16, **GEN_KW), 0, args.gen_repeats)
        eager["generate_4k_256_16steps_ms"] = round(med, 1)
        eager["generate_ms_per_step_all_in"] = round(med / 16, 2)
        log(f"eager generate 4K+256 @16 steps: {med:.0f} ms ({med / 16:.1f} ms/step all-in)  {samples}")
        save()
        del out
        torch.cuda.empty_cache()

        # --- static cache + torch.compile ---
        if not args.skip_compile:
            try:
                compiled_part(model, ids4k, args, res)
            except Exception as e:  # keep the eager numbers and the table; the run still exits non-zero
                traceback.print_exc()
                res["failures"].append(f"static+compile part failed: {e!r}"[:400])
            save()

    rows = [(f"eager denoise step, kv {kv} (ms)", eager["step_ms"][str(kv)]) for kv in kvs]
    rows += [(f"eager denoise step, kv {kv}: GPU busy (ms)", eager["step_gpu_busy_ms"].get(str(kv))) for kv in kvs]
    if not args.quick:
        rows += [("eager prefill 4096 (ms)", eager["prefill_4k_ms"]),
                 ("eager prefill 4096 (tok/s)", eager["prefill_4k_tok_s"]),
                 ("eager generate 4K+256 @16 steps (ms)", eager["generate_4k_256_16steps_ms"]),
                 ("eager generate, ms/step all-in", eager["generate_ms_per_step_all_in"])]
        c = res["compiled"]
        if c and "ms_per_step" in c:
            rows += [("compile warm-up calls (s)", " / ".join(str(x) for x in c["warmup_s"])),
                     ("static+compile generate 4K+256 @16 steps (ms)", c["generate_4k_256_16steps_ms"]),
                     ("static+compile generate 4K+256 @1 step (ms)", c["generate_4k_256_1step_ms"]),
                     ("static+compile ms/step ((t16-t1)/15)", c["ms_per_step"]),
                     ("static+compile ms/step all-in (t16/16)", c["ms_per_step_all_in"])]
    res["total_s"] = round(time.time() - T0, 1)
    save()
    print(f"\nHF transformers {transformers.__version__} / torch {torch.__version__} on {dev}: bf16, random weights, "
          f"attn={attn}, experts={experts_impl}, total {time.time() - T0:.0f} s")
    for n in res["notes"]:
        print("note:", n)
    w = max(len(r[0]) for r in rows)
    for name, val in rows:
        print(f"  {name:<{w}}  {'skipped' if val is None else val}")
    if args.json:
        print("json:", args.json)
    for f in res["failures"]:
        print("FAIL:", f)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
