#!/usr/bin/env python3
"""Per-kernel profile of denoise steps from an Nsight Systems trace (run on the GPU machine).

  tools/gpu/profile_step.sh  (the nsys / importer calls on the GPU image, then this script)
  python3 tools/gpu/profile_step.py /tmp/step_cuda_gpu_trace.csv [--steps 10]

A step ends with the row-statistics merge kernel (name containing 'rowstats_merge'); the last --steps steps are averaged. Prints,
per kernel in step order, the mean duration and the idle gap before it, then the step's wall time, kernel time and
idle total: where the time between kernels goes, which the bench's stage events cannot show inside a CUDA graph.
"""
import argparse
import csv
import sys
from collections import defaultdict


def short(name: str) -> str:
    name = name.split('(')[0]
    for prefix in ('void ', 'dg::cuda::', '(anonymous namespace)::'):
        name = name.replace(prefix, '')
    return name[:70]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument('trace_csv')
    ap.add_argument('--steps', type=int, default=10)
    ap.add_argument('--end-kernel', default='rowstats_merge')
    args = ap.parse_args()
    rows = []
    with open(args.trace_csv, newline='') as f:
        for r in csv.DictReader(f):
            name = r.get('Name', '')
            start = r.get('Start (ns)') or r.get('Start')
            dur = r.get('Duration (ns)') or r.get('Duration')
            if start is None or dur is None or name.startswith('[CUDA mem'):
                continue
            rows.append((int(float(start)), int(float(dur)), name))
    rows.sort()
    ends = [i for i, r in enumerate(rows) if args.end_kernel in r[2]]
    if len(ends) < args.steps + 1:
        print(f'only {len(ends)} step ends found (kernel name containing {args.end_kernel!r})', file=sys.stderr)
        return 1
    segs = [rows[ends[j] + 1:ends[j + 1] + 1] for j in range(len(ends) - args.steps - 1, len(ends) - 1)]
    n = len(segs[0])
    if any(len(s) != n for s in segs):
        print('steps differ in kernel count: ' + ' '.join(str(len(s)) for s in segs), file=sys.stderr)
        segs = [s for s in segs if len(s) == n]
    dur = [0.0] * n
    gap = [0.0] * n
    wall = busy = 0.0
    for s in segs:
        wall += (s[-1][0] + s[-1][1] - s[0][0]) / 1e3
        for i, (t, d, _) in enumerate(s):
            dur[i] += d / 1e3
            if i:
                gap[i] += max(0, t - (s[i - 1][0] + s[i - 1][1])) / 1e3
    k = len(segs)
    by_name = defaultdict(lambda: [0, 0.0, 0.0])
    print(f'{k} steps, {n} kernels a step')
    print(f'{"#":>4} {"us":>8} {"gap us":>7}  kernel')
    for i in range(n):
        nm = short(segs[0][i][2])
        print(f'{i:4d} {dur[i] / k:8.2f} {gap[i] / k:7.2f}  {nm}')
        b = by_name[nm]
        b[0] += 1
        b[1] += dur[i] / k
        b[2] += gap[i] / k
    print('\nby kernel (per step): count, us, gap us before')
    for nm, (c, d, g) in sorted(by_name.items(), key=lambda x: -x[1][1]):
        print(f'{c:5d} {d:9.1f} {g:8.1f}  {nm}')
    tot_d = sum(dur) / k
    tot_g = sum(gap) / k
    print(f'\nstep wall {wall / k:.1f} us, kernels {tot_d:.1f} us, idle gaps {tot_g:.1f} us '
          '(overlapping side-stream kernels make kernels + gaps exceed the wall)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
