#!/usr/bin/env python3
"""Summarizes `diffgemma bench --experts-timeline FILE` (the fused expert kernel's per-tile records of one step).

Per launch (a layer): when its blocks entered and returned from griddepcontrol.wait, when the first tile's data came
and the last tile ended, how the blocks' end times spread (the tail), how long gate_up / down tiles took, and how long
consumers waited for a tile's first stage. Launches are told apart by gaps in the blocks' entry times. Then, for the
middle launch, tiles running and waiting per 10 us, and the weight bytes consumed per 5 us (each tile's bytes spread
evenly over its first-stage-to-end span, so a rate, not a DRAM counter). Shapes default to the full-size model
(E 128, H 2816, I 704: 11 gate_up tiles of 44 stages and 22 down tiles of 11 stages an expert, 16 KB a stage).

  python3 tools/gpu/experts_timeline.py FILE [--experts E --hidden H --moe-intermediate I]
"""
import argparse, csv, statistics as st

STAGE_BYTES = 16384  # one 64-wide k slice of a 128-row weight tile, bf16

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--moe-intermediate", type=int, default=704)
    a = ap.parse_args()
    report(a.file, a.experts * (a.moe_intermediate // 64), a.hidden // 64, a.moe_intermediate // 64)

def report(path, n_gate, gate_stages, down_stages):
    rows = [dict((k, int(v)) for k, v in r.items()) for r in csv.DictReader(open(path))]
    if not rows:
        print("no records"); return
    entries = sorted((r for r in rows if r["tile"] == -1), key=lambda r: r["t0"])
    # launches: split entries where the gap exceeds 50 us
    launches, cur = [], [entries[0]]
    for r in entries[1:]:
        if r["t0"] - cur[-1]["t0"] > 50_000:
            launches.append(cur); cur = [r]
        else:
            cur.append(r)
    launches.append(cur)
    tiles = sorted((r for r in rows if r["tile"] >= 0), key=lambda r: r["t0"])
    print(f"{len(launches)} launches, {len(tiles)} tile records")
    print("launch  blocks  entry_spread  wait_ret_spread  first_data  last_end  span(first_data..last_end)  "
          "end_spread(p10..max)  gate_tile_us(med)  down_tile_us(med)  stall_first_stage_us(sum/block)")
    for li, L in enumerate(launches):
        t_start = L[0]["t0"]
        t_next = launches[li + 1][0]["t0"] if li + 1 < len(launches) else float("inf")
        lt = [r for r in tiles if t_start <= r["t0"] < t_next]
        if not lt:
            continue
        e0 = min(r["t0"] for r in L); e1 = max(r["t0"] for r in L)
        w0 = min(r["t1"] for r in L); w1 = max(r["t1"] for r in L)
        fd = min(r["t0"] for r in lt); le = max(r["t1"] for r in lt)
        ends = {}
        for r in lt:
            ends[r["block"]] = max(ends.get(r["block"], 0), r["t1"])
        ev = sorted(ends.values())
        p10 = ev[len(ev) // 10]
        g = [(r["t1"] - r["t0"]) / 1e3 for r in lt if r["tile"] < n_gate]
        d = [(r["t1"] - r["t0"]) / 1e3 for r in lt if r["tile"] >= n_gate]
        stall = sum((r["t0"] - r["t_req"]) for r in lt) / 1e3 / max(1, len(ends))
        us = lambda x: (x - t_start) / 1e3
        print(f"{li:6d} {len(L):7d} {us(e1):8.1f} {us(w0):8.1f}..{us(w1):6.1f} {us(fd):10.1f} {us(le):9.1f} "
              f"{(le - fd) / 1e3:10.1f} {(p10 - t_start) / 1e3:8.1f}..{us(ev[-1]):6.1f} "
              f"{st.median(g) if g else 0:10.1f} {st.median(d) if d else 0:10.1f} {stall:10.1f}")
    # the middle launch in detail: active blocks over time (10 us bins)
    L = launches[len(launches) // 2]
    t_start = L[0]["t0"]
    li = launches.index(L)
    t_next = launches[li + 1][0]["t0"] if li + 1 < len(launches) else float("inf")
    lt = [r for r in tiles if t_start <= r["t0"] < t_next]
    le = max(r["t1"] for r in lt)
    print(f"\nlaunch {li}: tiles running (consumer between t0 and t1) and waiting, per 10 us from the first entry")
    for b in range(0, int((le - t_start) / 1e3) + 10, 10):
        a0, a1 = t_start + b * 1000, t_start + (b + 10) * 1000
        run = sum(min(r["t1"], a1) - max(r["t0"], a0) for r in lt if r["t1"] > a0 and r["t0"] < a1) / 10_000
        wait = sum(min(r["t0"], a1) - max(r["t_req"], a0) for r in lt if r["t0"] > a0 and r["t_req"] < a1) / 10_000
        nd = sum(1 for r in lt if a0 <= r["t1"] < a1)
        print(f"  {b:5d} us: {run:6.1f} blocks computing, {wait:6.1f} waiting for a tile's first stage, {nd:4d} tiles ended")
    # per SM: first tile start
    sms = {}
    for r in lt:
        sms.setdefault(r["sm"], []).append(r)
    starts = sorted(min(x["t0"] for x in v) for v in sms.values())
    print(f"\nSMs used {len(sms)}; first data per SM (us from first entry): p0 {(starts[0]-t_start)/1e3:.1f} "
          f"p25 {(starts[len(starts)//4]-t_start)/1e3:.1f} p50 {(starts[len(starts)//2]-t_start)/1e3:.1f} "
          f"p75 {(starts[3*len(starts)//4]-t_start)/1e3:.1f} max {(starts[-1]-t_start)/1e3:.1f}")
    # weight bytes consumed per 5 us, from the first griddepcontrol.wait return (the route kernel's end)
    t_wait = min(r["t1"] for r in L)
    bins = [0.0] * (int((le - t_wait) / 5000) + 1)
    for r in lt:
        by = (gate_stages if r["tile"] < n_gate else down_stages) * STAGE_BYTES
        a, b = max(r["t0"], t_wait), r["t1"]
        if b <= a:
            continue
        for i in range(int((a - t_wait) // 5000), int((b - t_wait) // 5000) + 1):
            lo, hi = max(a, t_wait + i * 5000), min(b, t_wait + (i + 1) * 5000)
            if hi > lo and i < len(bins):
                bins[i] += by * (hi - lo) / (b - a)
    total = sum(bins)
    print(f"\nlaunch {li}: {total / 1e9:.3f} GB of weights in {(le - t_wait) / 1e3:.1f} us from the first wait's return "
          f"({total / (le - t_wait) / 1e3:.2f} TB/s); per 5 us:")
    for i in range(0, len(bins), 6):
        print("  " + "  ".join(f"{5 * j:4d} us {bins[j] / 5000 / 1e3:5.2f}" for j in range(i, min(i + 6, len(bins)))))

if __name__ == "__main__":
    main()
