#pragma once
// cuBLASLt GEMMs in the shapes the model needs, bf16 (or f32) operands with f32 accumulation. Descriptors and the
// chosen algorithm are cached per shape, so the step loop does no allocation and no heuristic search.
//
// Which algorithm: cuBLASLt's heuristic ranks candidates for a shape, but at our small-M shapes (256 canvas rows)
// its first pick is often not the fastest (e.g. too few tiles to fill 132 SMs without split-K). `gemm_tuned.inc`
// pins, per GPU architecture and shape, the configuration (algo id, tile, split-K, reduction, swizzle, stages,
// cluster) measured fastest by `diffgemma bench --tune-gemm`; it is chosen among the heuristic's candidates by
// matching that configuration (or, when the tuner found it by asking the heuristic per algorithm id and the overall
// heuristic does not return it, built from its attributes and checked by cublasLtMatmulAlgoCheck), so a fixed table
// gives a fixed algorithm (deterministic results from run to run), and a shape or GPU not in the table falls back
// to the heuristic's first pick. Split-K candidates whose partial
// sums would be reduced in bf16 are never used (precision policy: accumulation in f32).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dg::cuda {

enum class Dt { BF16, F32 };

// Tuning mode (`diffgemma bench --tune-gemm`): every new plan times all acceptable candidates on its first call (it
// synchronizes the stream; never during stream capture) and keeps the fastest; one report line per shape. The
// candidates: the heuristic's overall ones and, per algorithm id, the ones it offers for that id alone.
void set_gemm_tuning(bool on);
// A/B (bench --untuned-gemm): ignore the pinned algorithms of gemm_tuned.inc, take cuBLASLt's heuristic first pick.
// Set before the first GEMM of a shape is planned.
void set_gemm_table(bool on);
// A/B (bench --gemm-untable MxNxK): the same for the listed shapes only (m, n, k as the table writes them).
void set_gemm_table_skip(std::vector<std::array<int, 3>> shapes);
// A/B (bench --gemm-config MxNxK=c0,...,c8): this algorithm configuration (the nine CUBLASLT_ALGO_CONFIG_* values, as
// gemm_tuned.inc writes them) for every GEMM of that shape, in place of the table's; a configuration cuBLASLt rejects
// for the shape is an error.
void set_gemm_config_override(std::vector<std::pair<std::array<int, 3>, std::array<int64_t, 9>>> overrides);
bool gemm_tuning();
const std::vector<std::string>& gemm_tune_report();

class Gemm {
 public:
  // sm_count_target > 0: plans are chosen for that many SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), for GEMMs that
  // run concurrently with other work on the remaining SMs.
  explicit Gemm(size_t workspace_bytes = size_t(64) << 20, int sm_count_target = 0);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y[T, out] = x[T, in] . W[out, in]^T   (PyTorch Linear layout)
  void linear(const void* x, Dt xt, int T, const void* W, Dt wt, int out, int in, void* y, Dt yt, cudaStream_t s);
  // For b in [0, batch): y_b[T, out] = x_b[T, in] . W_b[out, in]^T with x_b = x + b T in, W_b = W + b out in,
  // y_b = y + b T out (the padded expert GEMMs: every expert's rows padded to T)
  void linear_batched(const void* x, Dt xt, int T, const void* W, Dt wt, int out, int in, void* y, Dt yt, int batch,
                      cudaStream_t s);
  // y[T, H] = p[T, V] . E[V, H]   (soft embedding through the table)
  void through_table(const void* p, Dt pt, int T, const void* E, Dt et, int V, int H, void* y, Dt yt, cudaStream_t s);
  // For b in [0, batch): column-major C_b[m, n] = op(A_b) B_b, op(A) = A^T when transa (A_b then [k, m]). A, B, C
  // are device arrays of `batch` matrix pointers (cuBLASLt's pointer-array batch), every A_b with leading dimension
  // lda, and so on. In the tuned table (gemm_tuned.inc) such a plan's batch is written negative.
  void batched_pointers(bool transa, int m, int n, int k, const void* A, Dt at, int lda, const void* B, Dt bt, int ldb,
                        void* C, Dt ct, int ldc, int batch, cudaStream_t s);

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // column-major C[m, n] = op(A) op(B), `batch` times at strides m k / k n / m n (pointer_array: A, B, C are arrays
  // of batch pointers); key: transa, m, n, k, dtypes, batch, leading dimensions, pointer_array
  using Key = std::tuple<bool, int, int, int, int, int, int, int, int, int, int, bool>;
  void run(bool transa, int m, int n, int k, const void* A, Dt at, int lda, const void* B, Dt bt, int ldb, void* C,
           Dt ct, int ldc, cudaStream_t s, int batch = 1, bool pointer_array = false);
  Plan make_plan(bool transa, int m, int n, int k, Dt at, Dt bt, Dt ct, int lda, int ldb, int ldc,
                 int batch, bool pointer_array, const void* A, const void* B, void* C, cudaStream_t s);
  cublasLtHandle_t handle_ = nullptr;
  int sm_count_target_ = 0;
  int sm_ = 0;  // compute capability major * 10 + minor (the tuned table's architecture key)
  void* workspace_ = nullptr;
  size_t workspace_bytes_;
  std::map<Key, Plan> plans_;
};

}  // namespace dg::cuda
