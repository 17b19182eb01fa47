# HF transformers on the full 26B-A4B shapes with random bf16 weights (same shapes as `diffgemma bench`), eager
# path: prefill and one denoise step (with SC logits) at kv 512 and 4096, per experts implementation.
# Based on ../shared/reference/hf_bench_example.py; the static-cache + torch.compile generate run (about 3 minutes of
# compile) is left to that script.
# Example: time HF transformers DiffusionGemma at the full 26B-A4B shapes with random bf16 weights on one GPU.
# Measured on one H200 (transformers 5.17, torch 2.11): denoise step 91 ms (kv 512), 110-142 ms (kv 4096);
# prefill 512 tokens 140 ms; generate 256 tokens with 48 steps 10.6 s. Vision tower is tiny (required by the class).
import time, torch, sys, json
from transformers import Gemma4VisionConfig, DiffusionGemmaConfig, DiffusionGemmaTextConfig, DiffusionGemmaForBlockDiffusion
torch.manual_seed(0)
tc = DiffusionGemmaTextConfig(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
    sliding_window=1024, num_experts=128, top_k_experts=8, moe_intermediate_size=704, max_position_embeddings=262144)
vc = Gemma4VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=32)
cfg = DiffusionGemmaConfig(text_config=tc, vision_config=vc, canvas_length=256)
print("layer_types", tc.layer_types)
t0 = time.time()
with torch.device("cuda"):
    torch.set_default_dtype(torch.bfloat16)
    model = DiffusionGemmaForBlockDiffusion(cfg)
torch.set_default_dtype(torch.float32)
model.eval()
torch.cuda.synchronize(); print("init_s", round(time.time()-t0,1), "params_B", sum(p.numel() for p in model.parameters())/1e9, "mem_GB", torch.cuda.memory_allocated()/1e9, flush=True)
try:
    print("experts_impl", model.get_experts_implementation())
except Exception as e: print("no get_experts_implementation", e)
res = {}
def timeit(fn, n=5):
    fn(); torch.cuda.synchronize()
    ts=[]
    for _ in range(n):
        torch.cuda.synchronize(); t=time.time(); fn(); torch.cuda.synchronize(); ts.append(time.time()-t)
    ts.sort(); return ts[len(ts)//2]
from transformers import DynamicCache
for impl in ["default", "grouped_mm", "batched_mm"]:
    if impl != "default":
        try: model.set_experts_implementation(impl)
        except Exception as e: print("impl", impl, "failed", e); continue
    for plen in [512, 4096]:
        ids = torch.randint(0, 262144, (1, plen), device="cuda")
        def prefill():
            with torch.no_grad():
                c = DynamicCache(config=cfg.text_config)
                model.model.encoder(input_ids=ids, past_key_values=c)
            return c
        try:
            tp = timeit(prefill, 3)
            cache = prefill()
            canvas = torch.randint(0, 262144, (1, 256), device="cuda")
            sc = torch.randn(1, 256, 262144, device="cuda", dtype=torch.bfloat16)
            def step():
                with torch.no_grad():
                    model(decoder_input_ids=canvas, past_key_values=cache, self_conditioning_logits=sc)
            ts = timeit(step, 5)
            res[f"{impl}_prefill{plen}_ms"] = round(tp*1e3,1); res[f"{impl}_step_kv{plen}_ms"] = round(ts*1e3,1)
            print(impl, plen, "prefill_ms", round(tp*1e3,1), "denoise_step_ms", round(ts*1e3,1), flush=True)
        except Exception as e:
            print("fail", impl, plen, repr(e)[:300], flush=True)
print("RESULT", json.dumps(res))
