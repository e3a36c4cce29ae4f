// Decode-projection benchmark: the quantised GEMV kernel (kernels/gemv.h) on the shapes of
// SmolLM2-135M (Q4_1 layer matrices, the Q8_0 output head), its 576x1536 down projection
// in every format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; compare the formats'
// GB/s within one run) and Gemma 3 270M's FFN shapes and tied head in the formats of a
// Q4_K_M file, each with 16-bit and with 8-bit activations (the two paths of kernels/gemv.h;
// 8 bits run VNNI byte dot products where the CPU has them), against OpenBLAS sgemv on the
// same matrices dequantised to float32. Each shape is replicated `--copies` times (30 = the
// model's layers) and the copies are visited in turn, so the weights stream from memory as
// in a decode step. Reported: achieved GB/s of weight bytes (codes and scales) against the
// machine's read bandwidth measured in the same run with the same threads, and CPU time per
// 32 weights of the single-threaded kernel (thread CPU time: insensitive to other processes
// taking the cores, unlike wall time).
//
// usage: gemv_bench [--threads 2] [--copies 30] [--reps 15] [--only TEXT] [--json FILE]
#include <cblas.h>
#include <hwy/targets.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cumulus/kernels/simd.h"
#include "cumulus/core/buffer.h"
#include "cumulus/core/dtype.h"
#include "cumulus/core/file.h"
#include "cumulus/core/thread_pool.h"
#include "cumulus/eval/bench.h"
#include "cumulus/eval/membw.h"
#include "cumulus/kernels/gemv.h"

extern "C" void openblas_set_num_threads(int num_threads);

using namespace cumulus;
using Clock = std::chrono::steady_clock;

namespace {

struct MatShape {
  const char* name;
  QuantFormat format;
  int rows, cols;
};

// One repacked matrix with random codes and scales, in the storage the model's matrices use
// (LargeVector: 2 MiB pages where a matrix spans them, model/weight_matrix.h).
struct Matrix {
  LargeVector<uint8_t> qs;
  LargeVector<uint16_t> d, m;
  LargeVector<uint32_t> qh;
  QuantMatrixView view;
  std::vector<float> f32;  // dequantised, for sgemv
};

Matrix make_matrix(const MatShape& s, std::mt19937& rng) {
  Matrix a;
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.001f, 0.05f);
  if (!quant_format_repacked(s.format)) {
    // The GGUF blocks as they are: random bytes, with finite f16 scales (d, and dmin after
    // it; Q6_K's d at byte 208).
    const size_t tb = static_cast<size_t>(quant_block_bytes(s.format));
    a.qs.resize(static_cast<size_t>(s.rows) * static_cast<size_t>(s.cols / quant_format_block(s.format)) * tb);
    for (auto& b : a.qs) b = static_cast<uint8_t>(byte(rng));
    const size_t d_at = s.format == QuantFormat::q6_k ? 208 : 0;
    const bool second = s.format != QuantFormat::q6_k;
    for (size_t blk = 0; blk < a.qs.size(); blk += tb) {
      const uint16_t d = f32_to_f16(sc(rng) * 0.1f), m = f32_to_f16(sc(rng) * 0.1f);
      std::memcpy(&a.qs[blk + d_at], &d, 2);
      if (second) std::memcpy(&a.qs[blk + 2], &m, 2);
    }
    a.view = {s.format, s.rows, s.cols, a.qs.data(), nullptr, nullptr};
  } else {
    const int nb = s.cols / kQuantBlock, stride = quant_scale_stride(s.cols);
    a.qs.resize(static_cast<size_t>(s.rows) * nb * quant_block_bytes(s.format));
    for (auto& b : a.qs) b = static_cast<uint8_t>(byte(rng));
    a.d.assign(static_cast<size_t>(s.rows) * stride, 0);
    if (s.format == QuantFormat::q4_1 || s.format == QuantFormat::q5_1) a.m.assign(a.d.size(), 0);
    if (s.format == QuantFormat::q5_0 || s.format == QuantFormat::q5_1) {
      a.qh.resize(static_cast<size_t>(s.rows) * nb);
      std::uniform_int_distribution<uint32_t> word;
      for (auto& h : a.qh) h = word(rng);
    }
    for (int r = 0; r < s.rows; ++r)
      for (int b = 0; b < nb; ++b) {
        a.d[static_cast<size_t>(r) * stride + b] = f32_to_f16(sc(rng));
        if (!a.m.empty()) a.m[static_cast<size_t>(r) * stride + b] = f32_to_f16(-sc(rng));
      }
    a.view = {s.format, s.rows, s.cols, a.qs.data(), a.d.data(), a.m.empty() ? nullptr : a.m.data(),
              a.qh.empty() ? nullptr : a.qh.data()};
  }
  a.f32.resize(static_cast<size_t>(s.rows) * s.cols);
  cpu::quant_dequantize_rows(a.view, 0, s.rows, a.f32.data());
  return a;
}

// Bytes a pass reads from one matrix: codes and scales (repacked: the padded scale rows,
// and Q5_x's bit-4 words).
size_t quant_bytes(const MatShape& s) {
  if (!quant_format_repacked(s.format))
    return static_cast<size_t>(s.rows) * static_cast<size_t>(s.cols / quant_format_block(s.format)) *
           static_cast<size_t>(quant_block_bytes(s.format));
  const size_t nb = static_cast<size_t>(s.cols / kQuantBlock);
  const bool has_min = s.format == QuantFormat::q4_1 || s.format == QuantFormat::q5_1;
  const bool has_qh = s.format == QuantFormat::q5_0 || s.format == QuantFormat::q5_1;
  const size_t scales = static_cast<size_t>(quant_scale_stride(s.cols)) * (has_min ? 2 : 1) * 2;
  return static_cast<size_t>(s.rows) * (nb * (quant_block_bytes(s.format) + (has_qh ? 4 : 0)) + scales);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Median wall seconds (and median thread CPU seconds) of one pass over all copies.
template <class Fn>
std::pair<double, double> time_pass(Fn&& pass, int reps) {
  pass();  // warm-up
  std::vector<double> wall, cpu;
  for (int i = 0; i < reps; ++i) {
    const double c0 = thread_cpu_seconds();
    const auto t0 = Clock::now();
    pass();
    wall.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    cpu.push_back(thread_cpu_seconds() - c0);
  }
  return {median(wall), median(cpu)};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    cumulus::cpu::simd_select_from_env();  // CUMULUS_SIMD caps the SIMD target (kernels/simd.h)
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  int threads = 2, copies = 30, reps = 15;
  std::string json_path, only;  // only: run the shapes whose name contains it
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--threads") threads = std::stoi(next());
    else if (a == "--copies") copies = std::stoi(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--json") json_path = next();
    else if (a == "--only") only = next();
    else {
      std::fprintf(stderr, "usage: gemv_bench [--threads 2] [--copies 30] [--reps 15] [--only TEXT] [--json FILE]\n");
      return 2;
    }
  }
  openblas_set_num_threads(1);
  ThreadPool pool(threads);
  const MemBwResult bw = membw_measure(pool, {.bytes = size_t{512} << 20, .warmup = 1, .repeats = 5});
  std::printf("gemv_bench: target %s, %d threads, machine read bandwidth %.1f GB/s; load average %.2f\n",
              hwy::TargetName(hwy::SupportedAndGeneratedTargets().front()), threads, bw.gbps_median, load_average());
  const MatShape shapes[] = {{"wq/wo 576x576", QuantFormat::q4_1, 576, 576},
                             {"wk/wv 192x576", QuantFormat::q4_1, 192, 576},
                             {"gate/up 1536x576", QuantFormat::q4_1, 1536, 576},
                             {"down 576x1536", QuantFormat::q4_1, 576, 1536},
                             {"head 49152x576 Q8_0", QuantFormat::q8_0, 49152, 576},
                             // Gemma 3 270M's tied head (token_embd), 178 MB.
                             {"g3 head 262144x640 Q8_0", QuantFormat::q8_0, 262144, 640},
                             // The down projection in every other format.
                             {"down 576x1536 Q4_0", QuantFormat::q4_0, 576, 1536},
                             {"down 576x1536 Q5_0", QuantFormat::q5_0, 576, 1536},
                             {"down 576x1536 Q5_1", QuantFormat::q5_1, 576, 1536},
                             {"down 576x1536 Q8_0", QuantFormat::q8_0, 576, 1536},
                             {"down 576x1536 Q4_K", QuantFormat::q4_k, 576, 1536},
                             {"down 576x1536 Q5_K", QuantFormat::q5_k, 576, 1536},
                             {"down 576x1536 Q6_K", QuantFormat::q6_k, 576, 1536},
                             // Gemma 3 270M (dim 640, FFN 2048): rows of 640 are not whole
                             // 256-blocks, so a Q4_K_M file stores them in Q5_0 or Q8_0.
                             {"g3 gate/up 2048x640 Q5_0", QuantFormat::q5_0, 2048, 640},
                             {"g3 down 640x2048 Q4_K", QuantFormat::q4_k, 640, 2048},
                             {"g3 down 640x2048 Q6_K", QuantFormat::q6_k, 640, 2048}};
  std::mt19937 rng(1);
  nlohmann::json out;
  out["threads"] = threads;
  out["membw_gbps"] = bw.gbps_median;
  out["gemv_quant_activation_bits"] = cpu::gemv_quant_activation_bits();
  std::printf("gemv_quant's activation width: %d bits (8-bit rows below use VNNI byte dot products where the CPU has "
              "them)\n", cpu::gemv_quant_activation_bits());
  std::printf("\n%-26s %6s %8s | %-28s | %-28s | %6s | %-21s\n", "", "", "", "16-bit activations", "8-bit activations",
              "8 vs", "OpenBLAS sgemv (f32)");
  std::printf("%-26s %6s %8s | %7s %6s %5s %6s | %7s %6s %5s %6s | %6s | %7s %5s %7s\n", "shape", "copies", "MB", "ms", "GB/s",
              "of bw", "cpu ns", "ms", "GB/s", "of bw", "cpu ns", "16", "ms", "GB/s", "vs best");
  for (const MatShape& s : shapes) {
    if (!only.empty() && std::string(s.name).find(only) == std::string::npos) continue;
    // The head is ~30 MB on its own: one copy streams from memory already.
    const int n = s.rows > 10000 ? 1 : copies;
    std::vector<Matrix> ms;
    for (int c = 0; c < n; ++c) ms.push_back(make_matrix(s, rng));
    std::vector<float> x(static_cast<size_t>(s.cols)), y(static_cast<size_t>(s.rows));
    std::normal_distribution<float> g;
    for (auto& v : x) v = g(rng);
    const double qbytes = static_cast<double>(quant_bytes(s)) * n;
    const double fbytes = static_cast<double>(s.rows) * s.cols * 4.0 * n;
    const double blocks = static_cast<double>(s.rows) * (s.cols / kQuantBlock) * n;
    // The quantised GEMV at both activation widths (kernels/gemv.h; 8 bits: VNNI byte dot
    // products where the CPU has them), split into tasks as cpu::gemv_quant splits them.
    QuantActivation xq;
    auto gemv_at = [&](const Matrix& m, int bits) {
      cpu::quant_activation(x.data(), s.cols, bits, xq);
      const int per = cpu::gemv_quant_task_rows(s.rows, pool.n_threads());
      pool.parallel_for((s.rows + per - 1) / per, [&](int64_t t, int) {
        const int r0 = static_cast<int>(t) * per;
        cpu::gemv_quant_rows(m.view, r0, std::min(s.rows, r0 + per), xq, y.data() + r0);
      });
    };
    double q_wall[2], q_cpu[2];  // [16 bits, 8 bits]
    for (int i = 0; i < 2; ++i) {
      const int bits = i == 0 ? 16 : 8;
      q_wall[i] = time_pass([&] { for (const Matrix& m : ms) gemv_at(m, bits); }, reps).first;
      q_cpu[i] = time_pass(
                     [&] {
                       for (const Matrix& m : ms) {
                         cpu::quant_activation(x.data(), s.cols, bits, xq);
                         cpu::gemv_quant_rows(m.view, 0, s.rows, xq, y.data());
                       }
                     },
                     reps)
                     .second;
    }
    // sgemv in the same row slices the model uses (64 rows per task).
    const auto [f_wall, f_cpu_unused] = time_pass(
        [&] {
          for (const Matrix& m : ms) {
            pool.parallel_for((s.rows + 63) / 64, [&](int64_t t, int) {
              const int r0 = static_cast<int>(t) * 64, nr = std::min(64, s.rows - r0);
              cblas_sgemv(CblasRowMajor, CblasNoTrans, nr, s.cols, 1.0f, m.f32.data() + static_cast<size_t>(r0) * s.cols,
                          s.cols, x.data(), 1, 0.0f, y.data() + r0, 1);
            });
          }
        },
        reps);
    (void)f_cpu_unused;
    const double g16 = qbytes / q_wall[0] / 1e9, g8 = qbytes / q_wall[1] / 1e9, f_gbps = fbytes / f_wall / 1e9;
    const double best = std::min(q_wall[0], q_wall[1]);
    std::printf("%-26s %6d %8.1f | %7.3f %6.1f %4.0f%% %6.2f | %7.3f %6.1f %4.0f%% %6.2f | %5.2fx | %7.3f %5.1f %6.2fx\n",
                s.name, n, qbytes / 1e6, 1e3 * q_wall[0], g16, 100 * g16 / bw.gbps_median, 1e9 * q_cpu[0] / blocks,
                1e3 * q_wall[1], g8, 100 * g8 / bw.gbps_median, 1e9 * q_cpu[1] / blocks, q_wall[0] / q_wall[1], 1e3 * f_wall,
                f_gbps, f_wall / best);
    out["shapes"].push_back({{"shape", s.name},
                             {"format", quant_format_name(s.format)},
                             {"rows", s.rows},
                             {"cols", s.cols},
                             {"copies", n},
                             {"quant_bytes", qbytes},
                             {"quant16_ms", 1e3 * q_wall[0]},
                             {"quant16_gbps", g16},
                             {"quant16_single_thread_cpu_ns_per_32_weights", 1e9 * q_cpu[0] / blocks},
                             {"quant8_ms", 1e3 * q_wall[1]},
                             {"quant8_gbps", g8},
                             {"quant8_single_thread_cpu_ns_per_32_weights", 1e9 * q_cpu[1] / blocks},
                             {"speedup_8_over_16", q_wall[0] / q_wall[1]},
                             {"sgemv_ms", 1e3 * f_wall},
                             {"sgemv_gbps", f_gbps},
                             {"speedup_vs_sgemv", f_wall / best}});
  }
  std::printf("ms: one pass over all copies with %d threads; cpu ns: single-threaded kernel, thread CPU time per 32 "
              "weights (activation rounding included); 8 vs 16: 16-bit time / 8-bit time; vs best: sgemv time / the faster "
              "width's time\n",
              threads);
  if (!json_path.empty()) {
    cumulus::file_write_atomic(json_path, out.dump(2) + "\n", "--json");
  }
  return 0;
}
