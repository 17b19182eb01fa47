#!/usr/bin/env python3
"""Records full DiffusionGemma generations from HF transformers, made deterministic with diffgemma's RNG, as parity
fixtures for src/diffusion (tests/test_generation_parity.cpp).

Runs on the GPU machine (transformers 5.17 + torch + numpy), on CPU tensors, from the repository root:
    HF_HUB_OFFLINE=1 python3 tools/reference/make_generation_fixtures.py \
        tests/fixtures/tiny-a tests/fixtures/tiny-b tests/fixtures/tiny-v --out tests/fixtures/generation

Inputs: HF save_pretrained directories (config.json, generation_config.json, model.safetensors) written by
tools/reference/make_fixtures.py, loaded in float32 (so the self-conditioning logits stay f32, as in the f32 CPU
engine). Output: <out>/<dir name>.json with, per case, the settings, the prompt ids, the expected output ids and the
denoising steps per canvas.

How HF's generate (transformers/models/diffusion_gemma/generation_diffusion_gemma.py) is made deterministic:
  * EntropyBoundSampler.initialize_canvas is the only randint: it draws the initial canvas of every block AND the
    full random canvas that renoise_canvas keeps at non-accepted positions. It is replaced by draws from the seed's
    LCG (state = state*6966169279 + 1039523323 mod 2^64, Rng(seed) starts at seed+1, advance then take the high 32
    bits u; token id = (u * V) >> 32), one stream per generate call, position order.
  * torch.multinomial (the denoiser draw in _denoising_step) is replaced by argmax: the seed's default denoiser.
  * sampler "hf" cases additionally replace the tokens accepted by EntropyBoundSampler.accept_canvas with
    categorical draws by Gumbel-max over the same stream: for every accepted position in ascending order, V
    uniforms u_i = (hi32 + 0.5) / 2^32 and token = argmax_i (z_i - log(-log u_i)) in float64, z = the tempered
    float32 logits; these draws come before that step's renoise draws (diffgemma's documented stream order).
No seed-only extras exist in HF, so the C++ side runs with GenerationOptions::disable_extras().

Self-check (printed, exit status 1 on FAIL, no fixture written unless --force): the LCG against a scalar loop and
known values; the patched HF generate against an independent re-implementation of the loop in this file (HF model
forward passes, our own accept / renoise / stop / chaining logic); HF run twice gives identical output; at least
one case per model stops early.
"""
import argparse
import collections
import json
import math
import os
import sys

import numpy as np
import torch
import transformers
from transformers import DiffusionGemmaForBlockDiffusion, DiffusionGemmaGenerationConfig, EntropyBoundSamplerConfig
import transformers.models.diffusion_gemma.generation_diffusion_gemma as GM

LCG_MUL = 6966169279
LCG_INC = 1039523323
U64 = (1 << 64) - 1


class Lcg:
    """The seed's LCG; draws are vectorized by jump-ahead (state_k = MUL^k s + INC (1 + MUL + ... + MUL^(k-1)))."""

    _pow = np.ones(1, dtype=np.uint64)      # MUL^j, j = 0..n
    _sum = np.ones(1, dtype=np.uint64)      # sum_{i<=j} MUL^i

    def __init__(self, seed):
        self.state = (seed + 1) & U64

    @classmethod
    def _grow(cls, n):
        if len(cls._pow) > n:
            return
        with np.errstate(over="ignore"):
            p = np.full(n + 1, LCG_MUL, dtype=np.uint64)
            p[0] = 1
            cls._pow = np.cumprod(p, dtype=np.uint64)  # wraps mod 2^64
            cls._sum = np.cumsum(cls._pow, dtype=np.uint64)

    def u32(self, n):
        """The next n outputs (high 32 bits of each new state) as uint64."""
        self._grow(n)
        s = np.uint64(self.state)
        with np.errstate(over="ignore"):
            states = self._pow[1:n + 1] * s + self._sum[0:n] * np.uint64(LCG_INC)
        self.state = int(states[-1])
        return states >> np.uint64(32)

    def tokens(self, n, vocab):
        return ((self.u32(n) * np.uint64(vocab)) >> np.uint64(32)).astype(np.int64)

    def uniforms(self, n):
        return (self.u32(n).astype(np.float64) + 0.5) * 2.0 ** -32


def lcg_scalar(seed, n):
    s, out = (seed + 1) & U64, []
    for _ in range(n):
        s = (s * LCG_MUL + LCG_INC) & U64
        out.append(s >> 32)
    return out


def schedule_temperature(cur, n, t_min, t_max):
    """diffgemma's T: HF's t_min + ((t_max - t_min) * (cur_step / N)) with cur_step an int32 tensor, i.e. float32
    arithmetic after the python-double t_max - t_min."""
    q = np.float32(cur / n)
    m = np.float32(np.float32(t_max - t_min) * q)
    return np.float32(np.float32(t_min) + m)


def gumbel_token(z_row, rng):
    """Categorical draw from softmax(z) by Gumbel-max; z_row: the float32 tempered logits of one position."""
    z = z_row.detach().cpu().numpy().astype(np.float64)
    u = rng.uniforms(z.shape[0])
    return int(np.argmax(z - np.log(-np.log(u))))  # first maximum on ties, as the C++ loop


# --------------------------------------------------------------------------------------------------------------
# Patched HF generate

class Patch:
    """Installs the deterministic sampler into HF for the duration of one generate call and counts steps."""

    def __init__(self, seed, sampler):
        self.rng = Lcg(seed)
        self.sampler = sampler
        self.steps = []
        self.temperatures = []  # the float32 divisor HF applied, per executed step, in call order
        self.divisor_exact = True
        self.in_renoise = False

    def __enter__(self):
        S = GM.EntropyBoundSampler
        for name in ("initialize_canvas", "accept_canvas", "renoise_canvas"):
            if not hasattr(S, name):
                raise SystemExit(f"transformers {transformers.__version__}: EntropyBoundSampler.{name} missing; "
                                 "this script targets the 5.17 generation loop")
        P = GM.LinearTemperatureScheduleLogitsProcessor
        self.saved = (S.initialize_canvas, S.accept_canvas, S.renoise_canvas, torch.multinomial, P.__call__)
        orig_accept, orig_renoise, orig_temp = S.accept_canvas, S.renoise_canvas, P.__call__
        patch = self

        # Same parameter names as the original: LogitsProcessorList passes cur_step by keyword after checking them.
        def temperature_call(proc, input_ids, scores, cur_step):
            out = orig_temp(proc, input_ids, scores, cur_step=cur_step)
            t = proc.t_min + ((proc.t_max - proc.t_min) * (cur_step / proc.max_denoising_steps))
            t32 = torch.as_tensor(t, dtype=torch.float32)
            patch.divisor_exact &= bool(torch.equal(out, scores / t32))
            patch.temperatures.append(float(t32))
            return out

        def initialize_canvas(sampler, batch_size, device):
            if not patch.in_renoise:
                patch.steps.append(0)  # a new block's canvas (HF draws it in _prepare_denoiser_inputs)
            ids = patch.rng.tokens(batch_size * sampler.canvas_length, sampler.vocab_size)
            return torch.from_numpy(ids).view(batch_size, sampler.canvas_length).to(device)

        def accept_canvas(sampler, current_canvas, denoiser_canvas, logits, cur_step):
            accepted = orig_accept(sampler, current_canvas, denoiser_canvas, logits, cur_step)
            if patch.sampler != "hf":
                return accepted
            mask = sampler.accepted_token_mask
            drawn = denoiser_canvas.clone()
            for b in range(mask.shape[0]):
                for i in torch.nonzero(mask[b]).flatten().tolist():  # ascending positions
                    drawn[b, i] = gumbel_token(logits[b, i], patch.rng)
            return torch.where(mask, drawn, current_canvas)

        def renoise_canvas(sampler, accepted_canvas, cur_step):
            patch.steps[-1] += 1  # one renoise per denoising step
            patch.in_renoise = True
            try:
                return orig_renoise(sampler, accepted_canvas, cur_step)
            finally:
                patch.in_renoise = False

        S.initialize_canvas, S.accept_canvas, S.renoise_canvas = initialize_canvas, accept_canvas, renoise_canvas
        P.__call__ = temperature_call
        torch.multinomial = lambda probs, num_samples=1, *a, **k: probs.argmax(-1, keepdim=True)
        return self

    def __exit__(self, *exc):
        S, P = GM.EntropyBoundSampler, GM.LinearTemperatureScheduleLogitsProcessor
        S.initialize_canvas, S.accept_canvas, S.renoise_canvas, torch.multinomial, P.__call__ = self.saved
        return False


def hf_generate(model, prompt, case):
    s = case["settings"]
    gc = DiffusionGemmaGenerationConfig(
        max_new_tokens=s["max_new_tokens"], max_denoising_steps=s["max_denoising_steps"],
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=float(s["entropy_bound"])),
        t_min=float(s["t_min"]), t_max=float(s["t_max"]), stability_threshold=int(s["stability_threshold"]),
        confidence_threshold=float(s["confidence_threshold"]), eos_token_id=s["eos_token_id"],
        pad_token_id=s["pad_token_id"])
    with torch.no_grad(), Patch(case["seed"], case["sampler"]) as p:
        out = model.generate(torch.tensor([prompt]), generation_config=gc, return_dict_in_generate=True)
    seq = out.sequences if hasattr(out, "sequences") else out
    if not p.divisor_exact:
        raise SystemExit("HF's tempered logits are not logits / float32(T): the temperature record is wrong")
    first_canvas = p.temperatures[:p.steps[0]]
    return seq[0].tolist()[len(prompt):], p.steps, first_canvas


# --------------------------------------------------------------------------------------------------------------
# Independent re-implementation of the loop (model-reference §4.1 / §7 ref_generate), HF forward passes only

def ref_generate(model, prompt, case, V, L):
    s = case["settings"]
    N, bound = s["max_denoising_steps"], s["entropy_bound"]
    stab, conf, eos = s["stability_threshold"], s["confidence_threshold"], s["eos_token_id"] or []
    rng = Lcg(case["seed"])
    seq, used, pkv, last, cur = [], [], None, None, len(prompt)
    with torch.no_grad():
        for _ in range(math.ceil(s["max_new_tokens"] / L)):
            if last is not None:
                model.model.encoder(input_ids=last[None], past_key_values=pkv,
                                    position_ids=torch.arange(cur - L, cur)[None])
            canvas = torch.from_numpy(rng.tokens(L, V))
            sc, hist, steps = None, collections.deque(maxlen=max(stab, 1)), 0
            for cur_step in range(N, 0, -1):
                steps += 1
                if pkv is None:
                    out = model(input_ids=torch.tensor([prompt]), decoder_input_ids=canvas[None])
                    pkv = out.past_key_values
                else:
                    out = model(past_key_values=pkv, decoder_input_ids=canvas[None],
                                self_conditioning_logits=None if sc is None else sc[None])
                T = schedule_temperature(cur_step, N, s["t_min"], s["t_max"])
                pl = out.logits[0].float() / torch.tensor(float(T), dtype=torch.float32)
                am = pl.argmax(-1)
                ent = torch.distributions.Categorical(logits=pl).entropy()
                order = sorted(range(L), key=lambda i: (ent[i].item(), i))
                acc, cum = torch.zeros(L, dtype=torch.bool), 0.0
                for i in order:  # cumsum in double stored as float32, minus current, <= bound, all float32
                    e = float(ent[i])
                    cum += e
                    acc[i] = bool(np.float32(cum) - np.float32(e) <= np.float32(bound))
                den = am.clone()
                if case["sampler"] == "hf":
                    for i in range(L):
                        if acc[i]:
                            den[i] = gumbel_token(pl[i], rng)
                noise = torch.from_numpy(rng.tokens(L, V))
                canvas = torch.where(acc, den, noise)
                stable = stab == 0 or (len(hist) == stab and all(bool((h == am).all()) for h in hist))
                hist.append(am)
                sc = pl
                if stable and float(ent.mean()) < np.float32(conf):
                    break
            used.append(steps)
            block = am.tolist()
            cur += L
            last = am
            if any(t in eos for t in block):  # HF keeps the first EOS and pads the rest of the canvas
                k = next(i for i, t in enumerate(block) if t in eos)
                seq += block[:k + 1] + [s["pad_token_id"]] * (L - k - 1)
                break
            seq += block
    return seq, used


def expected_output(new_tokens, case):
    """What diffgemma returns (+ its stop token): HF's tokens cut to max_new_tokens, through the first stop id."""
    s = case["settings"]
    cut = new_tokens[:s["max_new_tokens"]]
    for i, t in enumerate(cut):
        if t in (s["eos_token_id"] or []):
            return cut[:i + 1], t
    return cut, None


# --------------------------------------------------------------------------------------------------------------

def settings(**kw):
    base = dict(max_new_tokens=40, max_denoising_steps=8, entropy_bound=0.1, t_min=0.4, t_max=0.8,
                stability_threshold=1, confidence_threshold=0.005, eos_token_id=[1, 106, 50], pad_token_id=0)
    base.update(kw)
    return base


def make_cases(V, L, sliding_window):
    g = torch.Generator().manual_seed(1234 + V)
    def prompt(n):
        return [2] + torch.randint(3, V, (n - 1,), generator=g).tolist()
    p_short, p_long, p_mid = prompt(4), prompt(2 * sliding_window + 5), prompt(sliding_window + 1)
    two_and_half = 2 * L + L // 2
    return [
        dict(name="checkpoint-rule", seed=7, sampler="seed", prompt_ids=p_long,
             settings=settings(max_new_tokens=two_and_half)),
        dict(name="exact-multiple-no-eos", seed=3, sampler="seed", prompt_ids=p_short,
             settings=settings(max_new_tokens=2 * L, eos_token_id=None)),
        dict(name="stability0-stops-at-step1", seed=11, sampler="seed", prompt_ids=p_mid,
             settings=settings(max_new_tokens=3 * L - 3, stability_threshold=0, confidence_threshold=1000.0)),
        dict(name="stability1-huge-confidence", seed=5, sampler="seed", prompt_ids=p_long,
             settings=settings(max_new_tokens=two_and_half, confidence_threshold=1000.0, max_denoising_steps=10)),
        dict(name="accept-all-fixed-point", seed=8, sampler="seed", prompt_ids=p_mid,
             settings=settings(max_new_tokens=2 * L + 1, entropy_bound=1e9, confidence_threshold=1000.0,
                               max_denoising_steps=12)),
        dict(name="stability2-odd-schedule", seed=21, sampler="seed", prompt_ids=p_short,
             settings=settings(max_new_tokens=two_and_half, stability_threshold=2, confidence_threshold=1000.0,
                               max_denoising_steps=7, t_min=0.3, t_max=1.1, entropy_bound=0.35)),
        dict(name="categorical-hf-sampler", seed=13, sampler="hf", prompt_ids=p_long,
             settings=settings(max_new_tokens=two_and_half, entropy_bound=0.5, max_denoising_steps=6)),
        dict(name="categorical-stability0", seed=17, sampler="hf", prompt_ids=p_mid,
             settings=settings(max_new_tokens=2 * L, stability_threshold=0, confidence_threshold=1000.0,
                               entropy_bound=2.0)),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dirs", nargs="+", help="tiny checkpoints, e.g. tests/fixtures/tiny-a")
    ap.add_argument("--out", default="tests/fixtures/generation")
    ap.add_argument("--force", action="store_true", help="write fixtures even when the self-check fails")
    args = ap.parse_args()
    torch.manual_seed(0)
    print("transformers", transformers.__version__, "torch", torch.__version__, "numpy", np.__version__)
    ok = True

    # LCG: vectorized == scalar, and the values the C++ unit test pins.
    for seed in (0, 42, 2**64 - 1):
        r = Lcg(seed)
        got = r.u32(700).tolist() + r.u32(5).tolist()
        want = lcg_scalar(seed, 705)
        ok &= got == want
        print(f"lcg seed {seed}: vectorized == scalar: {got == want}")
    pinned = Lcg(0).u32(4).tolist() == [1, 99832574, 1806711590, 3679581957]
    pinned &= Lcg(42).tokens(3, 512).tolist() == [0, 262, 449]
    print("lcg pinned values:", pinned)
    ok &= pinned

    fixtures = []
    for d in args.model_dirs:
        name = os.path.basename(os.path.normpath(d))
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(d, dtype=torch.float32).eval()
        tc = model.config.get_text_config(decoder=True)
        V, L, W = tc.vocab_size, model.config.canvas_length, tc.sliding_window
        cases, early = [], False
        for case in make_cases(V, L, W):
            hf_new, hf_steps, temps = hf_generate(model, case["prompt_ids"], case)
            ref_new, ref_steps = ref_generate(model, case["prompt_ids"], case, V, L)
            s = case["settings"]
            ours = [float(schedule_temperature(c, s["max_denoising_steps"], s["t_min"], s["t_max"]))
                    for c in range(s["max_denoising_steps"], 0, -1)][:len(temps)]
            if temps != ours:
                print(f"  temperature schedule FAIL: HF {temps} vs diffgemma {ours}")
            same = hf_new == ref_new and hf_steps == ref_steps and temps == ours
            ok &= same
            N = case["settings"]["max_denoising_steps"]
            early |= any(k < N for k in hf_steps)
            exp, stop = expected_output(hf_new, case)
            print(f"{name} {case['name']}: steps per canvas {hf_steps}, {len(exp)} tokens, stop {stop}, "
                  f"HF == ref loop: {'PASS' if same else 'FAIL'}")
            if not same:
                print(f"  HF  {hf_new}\n  ref {ref_new}\n  steps HF {hf_steps} ref {ref_steps}")
            cases.append(dict(case, expected_ids=exp, stop_token=stop, steps_per_canvas=hf_steps,
                              temperatures=temps, hf_new_tokens=hf_new))
        # A case that is guaranteed to end on a stop id: a token of the no-eos run's second canvas becomes the stop.
        base = next(c for c in cases if c["name"] == "exact-multiple-no-eos")
        stop_id = base["expected_ids"][L + 3]
        case = dict(name="custom-stop-id-second-canvas", seed=base["seed"], sampler="seed",
                    prompt_ids=base["prompt_ids"], settings=dict(base["settings"], eos_token_id=[stop_id]))
        hf_new, hf_steps, temps = hf_generate(model, case["prompt_ids"], case)
        ref_new, ref_steps = ref_generate(model, case["prompt_ids"], case, V, L)
        exp, stop = expected_output(hf_new, case)
        same = hf_new == ref_new and hf_steps == ref_steps and stop == stop_id and len(exp) <= L + 4
        ok &= same
        print(f"{name} {case['name']}: stop {stop} after {len(exp)} tokens: {'PASS' if same else 'FAIL'}")
        cases.append(dict(case, expected_ids=exp, stop_token=stop, steps_per_canvas=hf_steps, temperatures=temps,
                          hf_new_tokens=hf_new))

        again, again_steps, _ = hf_generate(model, cases[0]["prompt_ids"], cases[0])
        rerun = again == cases[0]["hf_new_tokens"] and again_steps == cases[0]["steps_per_canvas"]
        print(f"{name}: HF rerun identical: {rerun}; some canvas stopped early: {early}")
        ok &= rerun and early
        fixtures.append((name, dict(format=1, model=name, vocab_size=V, canvas_length=L,
                                    transformers_version=transformers.__version__, torch_version=torch.__version__,
                                    rng="lcg state*6966169279+1039523323, Rng(seed)=seed+1, id=(hi32*V)>>32",
                                    cases=cases)))

    print("GENERATION FIXTURES", "PASS" if ok else "FAIL")
    if ok or args.force:
        os.makedirs(args.out, exist_ok=True)
        for name, fx in fixtures:
            path = os.path.join(args.out, f"{name}.json")
            with open(path, "w") as f:
                json.dump(fx, f, indent=1)
                f.write("\n")
            print("wrote", path)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
