#!/usr/bin/env python3
"""Issue #5's acceptance, read from one run_all.sh call (bench.json, hf_bench.json and the test exit codes).

    python3 tools/gpu/verdict.py --bench OUT/bench.json --hf OUT/hf_bench.json \\
        --kernels-rc 0 --parity-rc 0 --fullshape-rc 0
    python3 tools/gpu/verdict.py --self-test

Prints one line per criterion (PASS / FAIL / MISSING) and a last line "verdict: ...". Every ratio uses numbers of the
same call: the 4K step's median against HF's eager step at kv 4096 and its static+compile ms/step. The exit code is 0
when every criterion passes, 1 otherwise (run_all.sh only logs it).
"""
import argparse
import json
import sys

STEP_MS_MAX = 15.0          # denoise step at kv 4096, bf16
EAGER_RATIO_MIN = 6.0       # x transformers eager, same run
COMPILED_RATIO_MIN = 2.0    # x transformers static cache + torch.compile, same run
PREFILL_TOK_S_MIN = 20000   # prefill at 4K


def judge(bench, hf, rcs):
    """[(criterion, status, detail)] for the acceptance list; bench / hf are the parsed JSON (None if absent)."""
    rows = []

    def add(name, ok, detail):
        rows.append((name, "MISSING" if ok is None else ("PASS" if ok else "FAIL"), detail))

    device = (bench or {}).get("device")
    add("device is an H200", None if device is None else "H200" in device, device or "no bench.json")
    step = ((bench or {}).get("denoise") or {}).get("4096") or {}
    ms = step.get("step_ms")
    add(f"4K step <= {STEP_MS_MAX} ms", None if ms is None else ms <= STEP_MS_MAX,
        "no 4K step in bench.json" if ms is None else f"median {ms:.2f} ms (min {step.get('step_ms_min', 0):.2f})")
    hf_eager = (hf or {}).get("eager") or {}
    eager = (hf_eager.get("step_ms") or {}).get("4096")
    if ms is None or not eager:
        add(f"x{EAGER_RATIO_MIN:g} HF eager", None, f"HF eager step {eager}")
    else:
        busy = (hf_eager.get("step_gpu_busy_ms") or {}).get("4096")
        add(f"x{EAGER_RATIO_MIN:g} HF eager", eager / ms >= EAGER_RATIO_MIN,
            f"HF eager {eager:.2f} ms / {ms:.2f} = {eager / ms:.2f}x (needs HF eager >= {EAGER_RATIO_MIN * ms:.1f} ms"
            + ("" if busy is None else f"; its GPU busy {busy:.1f} ms of the {eager:.1f}") + ")")
    compiled = ((hf or {}).get("compiled") or {}).get("ms_per_step")
    if ms is None or not compiled:
        add(f"x{COMPILED_RATIO_MIN:g} HF compiled", None, f"HF compiled ms/step {compiled}")
    else:
        add(f"x{COMPILED_RATIO_MIN:g} HF compiled", compiled / ms >= COMPILED_RATIO_MIN,
            f"HF compiled {compiled:.2f} ms / {ms:.2f} = {compiled / ms:.2f}x")
    tok_s = (((bench or {}).get("prefill") or {}).get("4096") or {}).get("tok_per_s")
    add(f"prefill 4K >= {PREFILL_TOK_S_MIN} tok/s", None if tok_s is None else tok_s >= PREFILL_TOK_S_MIN,
        "no 4K prefill in bench.json" if tok_s is None else f"{tok_s:.0f} tok/s")
    for name, rc in rcs:
        # run_all.sh passes "skipped" or "N (fixture script rc M)" for the full-shape check
        rc = (rc or "").strip()
        first = rc.split()[0] if rc else ""
        fixture_ok = "fixture script rc" not in rc or rc.rstrip(")").split()[-1] == "0"
        add(name, None if first in ("", "skipped") else first == "0" and fixture_ok, f"rc {rc or 'missing'}")
    return rows


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def report(rows):
    w = max(len(r[0]) for r in rows)
    for name, status, detail in rows:
        print(f"[verdict] {status:<7} {name:<{w}}  {detail}")
    bad = [r[0] for r in rows if r[1] != "PASS"]
    print("[verdict] issue #5 acceptance: " + ("ALL PASS" if not bad else "not met (" + "; ".join(bad) + ")"))
    return 0 if not bad else 1


def self_test():
    bench = {"device": "NVIDIA H200", "denoise": {"4096": {"step_ms": 14.8, "step_ms_min": 14.7}},
             "prefill": {"4096": {"tok_per_s": 50000.0}}}
    hf = {"eager": {"step_ms": {"4096": 96.0}}, "compiled": {"ms_per_step": 36.0}}
    rcs = [("kernel tests", "0"), ("parity", "0"), ("full shape vs HF", "0 (fixture script rc 0)")]
    rows = judge(bench, hf, rcs)
    assert all(r[1] == "PASS" for r in rows), rows
    slow_hf = dict(hf, eager={"step_ms": {"4096": 80.0}})
    rows = dict((r[0], r[1]) for r in judge(bench, slow_hf, rcs))
    assert rows["x6 HF eager"] == "FAIL", rows  # 80 / 14.8 = 5.4
    busy_hf = dict(hf, eager={"step_ms": {"4096": 96.0}, "step_gpu_busy_ms": {"4096": 41.5}})
    detail = [r[2] for r in judge(bench, busy_hf, rcs) if r[0] == "x6 HF eager"][0]
    assert "needs HF eager >= 88.8 ms" in detail and "GPU busy 41.5 ms" in detail, detail
    rows = dict((r[0], r[1]) for r in judge(bench, None, [("full shape vs HF", "0 (fixture script rc 1)")]))
    assert rows["x6 HF eager"] == "MISSING" and rows["full shape vs HF"] == "FAIL", rows
    rows = dict((r[0], r[1]) for r in judge(dict(bench, device="NVIDIA H100 80GB HBM3"), hf, [("parity", "skipped")]))
    assert rows["device is an H200"] == "FAIL" and rows["parity"] == "MISSING", rows
    rows = dict((r[0], r[1]) for r in judge(None, None, []))
    assert rows["4K step <= 15.0 ms"] == "MISSING", rows
    print("verdict self-test: ok")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", help="bench.json of the call")
    ap.add_argument("--hf", help="hf_bench.json of the same call")
    ap.add_argument("--kernels-rc", default="")
    ap.add_argument("--parity-rc", default="")
    ap.add_argument("--fullshape-rc", default="")
    ap.add_argument("--self-test", action="store_true", help="check the judging on made-up numbers and exit")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    rcs = [("kernel tests", a.kernels_rc), ("tiny-fixture parity", a.parity_rc), ("full shape vs HF", a.fullshape_rc)]
    return report(judge(load(a.bench) if a.bench else None, load(a.hf) if a.hf else None, rcs))


if __name__ == "__main__":
    sys.exit(main())
