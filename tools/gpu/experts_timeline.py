#!/usr/bin/env python3
"""Summarizes `diffgemma bench --experts-timeline FILE` (the fused expert kernel's per-tile records of one step).

Per launch (a layer): when its blocks entered and returned from griddepcontrol.wait, when the first tile's data came
and the last tile ended, how the blocks' end times spread (the tail), how long gate_up / down tiles took, and how long
consumers waited for a tile's first stage. Launches are told apart by gaps in the blocks' entry times.
"""
import csv, sys, statistics as st

def main(path):
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
    n_gate = 128 * 11  # the model's gate_up tiles (E x I / 64)
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

if __name__ == "__main__":
    main(sys.argv[1])
