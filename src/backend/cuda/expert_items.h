#pragma once
// The work items of the prefill expert kernels (kernels_experts_prefill.cu), shared by the kernel and its CPU test:
// item = (expert e, weight tile nt, token tile j), numbered expert by expert, an expert's (nt, j) with j fastest, an
// expert with `rows` grouped token rows having ceil(rows / tok_item) token tiles for each of its tiles_n weight tiles.
#include <cstdint>

#if defined(__CUDACC__)
#define DG_EXPERT_ITEMS_FN __host__ __device__ __forceinline__
#else
#define DG_EXPERT_ITEMS_FN inline
#endif

namespace dg::cuda {

// Items of an expert with `rows` token rows.
DG_EXPERT_ITEMS_FN int expert_prefill_items(int rows, int tiles_n, int tok_item) {
  return (rows + tok_item - 1) / tok_item * tiles_n;
}

struct ExpertPrefillItem {
  int e, nt, row0, rows;  // expert, weight tile, first grouped token row, token rows (1 .. tok_item)
};

// Item `item` (< item_start[E]) given the experts' first rows offs[0 .. E] (moe_group's offsets) and their first items
// item_start[0 .. E]. The expert is the last one whose items start at or before `item`: experts without rows start
// where the next one does, so the search never lands on one.
DG_EXPERT_ITEMS_FN ExpertPrefillItem expert_prefill_item_at(int item, const int* item_start, const int* offs, int E,
                                                            int tok_item) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (item_start[mid] <= item)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int q = item - item_start[lo], start = offs[lo], cnt = offs[lo + 1] - start;
  const int S = (cnt + tok_item - 1) / tok_item, j = q % S;
  const int left = cnt - j * tok_item;
  return ExpertPrefillItem{lo, q / S, start + j * tok_item, left < tok_item ? left : tok_item};
}

}  // namespace dg::cuda

#undef DG_EXPERT_ITEMS_FN
