// capi.cu -- a plain C API (ctypes-friendly) over DeepSeek FlashMLA's sm90 dense MLA decode, for
// helixserve.kernels.mla.flashmla.
//
// helixserve's own code. FlashMLA (https://github.com/deepseek-ai/FlashMLA, MIT license, Copyright (c) 2025
// DeepSeek) and CUTLASS (BSD-3-Clause, NVIDIA) are fetched by build.sh at build time and compiled next to
// this file; neither is vendored in this repository. The built library carries their code: ship their
// license texts with it.
//
// It fills FlashMLA's DenseAttnDecodeParams / GetDecodeSchedMetaParams / CombineParams exactly as FlashMLA's
// csrc/api/dense_decode.h (dense_attn_decode_interface, commit 9241ae3) does for the MLA case (one KV head,
// head dim 576, value dim 512, 64-token pages), and calls its three host launchers:
//   smxx::decode::run_get_decoding_sched_meta_kernel   (tile scheduler metadata + num_splits)
//   sm90::run_flash_splitkv_mla_kernel<bfloat16_t>      (split-KV MLA forward)
//   smxx::decode::run_flash_mla_combine_kernel<bf16>    (merge of the splits)
// No allocation happens here: the caller passes every buffer (workspace sizes from
// flashmla_workspace_sizes), so the calls can be captured in a CUDA graph.
//
// Conventions (all pointers are device pointers; all strides are in ELEMENTS, not bytes):
//   q           [b, s_q, h_q, 576] bf16, last dim contiguous; needs stride_s == h_q * stride_h (so that FlashMLA's
//               view q -> [b, s_q*h_q, 1, 576] is a view, as in its python API for h_k = 1)
//   kcache      [num_blocks, 64, 1, 576] bf16, last dim contiguous (V = first 512 columns of K)
//   block_table [b, >= ceil(max seqlen / 64)] int32, last dim contiguous; every entry FlashMLA reads must be a
//               valid block (there is no "not held" marker)
//   seqlens_k   [b] int32, contiguous
//   out         [b, s_q, h_q, 512] bf16, CONTIGUOUS (FlashMLA writes it through TMA and the combine kernel with
//               strides derived from the shape)
//   lse         [b, s_q, h_q] float32, CONTIGUOUS. This is FlashMLA's raw buffer layout ([b, h_k=1, s_q*h_q]);
//               flash_mla_with_kvcache() returns it as a transposed copy [b, h_q, s_q]. Natural log
//               (the kernel writes logf(L) + m/log2(e), the combine writes log2-lse / log2(e)); a row with no
//               key gets +inf.
//   workspace   tile_md [num_sm_parts, 8] int32, num_splits [b+1] int32, lse_accum [b+num_sm_parts, s_q*h_q] f32,
//               o_accum [b+num_sm_parts, s_q*h_q, 512] f32; sizes from flashmla_workspace_sizes().
//   stream      a cudaStream_t (e.g. torch.cuda.current_stream().cuda_stream), passed as void*.
// Every function returns 0 on success, nonzero on error; flashmla_last_error() gives the message (per thread).
// The CUDA runtime is linked statically: it works in the device's primary context, which it shares with
// torch. Call flashmla_set_device(torch.cuda.current_device()) first when not on device 0.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include <cutlass/bfloat16.h>
#include <cutlass/fast_math.h>

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"
#include "smxx/decode/combine/combine.h"

#define FLASHMLA_CAPI extern "C" __attribute__((visibility("default")))

namespace {

thread_local std::string g_last_error;

constexpr int kHeadDimK = 576;
constexpr int kHeadDimV = 512;
constexpr int kPageBlockSize = 64;
constexpr int kMaxCombineSplits = 160;  // run_flash_mla_combine_kernel's MLA_NUM_SPLITS_SWITCH limit

struct CapiError : std::exception {
    std::string msg;
    explicit CapiError(std::string m) : msg(std::move(m)) {}
    const char* what() const noexcept override { return msg.c_str(); }
};

#define CAPI_REQUIRE(cond, msg)                                                     \
    do {                                                                            \
        if (!(cond)) throw CapiError(std::string("flashmla capi: ") + (msg));       \
    } while (0)

#define CAPI_CUDA(call)                                                             \
    do {                                                                            \
        cudaError_t e_ = (call);                                                    \
        if (e_ != cudaSuccess)                                                      \
            throw CapiError(std::string("flashmla capi: ") + #call + ": " + cudaGetErrorString(e_)); \
    } while (0)

template <typename F>
int guarded(F&& f) {
    try {
        f();
        g_last_error.clear();
        return 0;
    } catch (const std::exception& e) {
        g_last_error = e.what();
    } catch (...) {
        g_last_error = "flashmla capi: unknown C++ exception";
    }
    return 1;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Arch() of csrc/api/common.h, for the current device of this (static) runtime.
void query_arch(int* major, int* minor, int* num_sms) {
    int dev = 0;
    CAPI_CUDA(cudaGetDevice(&dev));
    CAPI_CUDA(cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, dev));
    CAPI_CUDA(cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, dev));
    CAPI_CUDA(cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, dev));
}

// dense_attn_decode_interface: num_sm_parts = max(num_sms / h_k / ceil_div(s_q*h_q/h_k, 64), 1), h_k = 1.
int compute_num_sm_parts(int num_sms, int s_q, int h_q) {
    const int h_k = 1;
    return std::max(num_sms / h_k / cutlass::ceil_div(s_q * h_q / h_k, 64), 1);
}

}  // namespace

// Bumped whenever a signature or convention of this file changes; the Python loader refuses other values.
FLASHMLA_CAPI int flashmla_capi_version(void) { return 1; }

FLASHMLA_CAPI const char* flashmla_last_error(void) { return g_last_error.c_str(); }

FLASHMLA_CAPI int flashmla_set_device(int device) {
    return guarded([&] { CAPI_CUDA(cudaSetDevice(device)); });
}

// Number of SMs of the current device (what FlashMLA's Arch().num_sms reads); -1 on error.
FLASHMLA_CAPI int flashmla_num_sms(void) {
    int major = 0, minor = 0, num_sms = -1;
    if (guarded([&] { query_arch(&major, &minor, &num_sms); }) != 0) return -1;
    return num_sms;
}

// Workspace sizes in BYTES for a (b, s_q, h_q) decode; num_sms <= 0 queries the current device.
// sizes_out[0] tile scheduler metadata (int32 [num_sm_parts, 8]), [1] num_splits (int32 [b+1]),
// [2] lse_accum (f32 [b+num_sm_parts, s_q*h_q]), [3] o_accum (f32 [b+num_sm_parts, s_q*h_q, 512]).
// *num_sm_parts_out receives num_sm_parts.
FLASHMLA_CAPI int flashmla_workspace_sizes(int b, int s_q, int h_q, int num_sms, int64_t* sizes_out,
                                           int* num_sm_parts_out) {
    return guarded([&] {
        CAPI_REQUIRE(b > 0 && s_q > 0 && h_q > 0, "b, s_q, h_q must be positive");
        int sms = num_sms;
        if (sms <= 0) {
            int major = 0, minor = 0;
            query_arch(&major, &minor, &sms);
        }
        const int parts = compute_num_sm_parts(sms, s_q, h_q);
        const int64_t total_num_splits = int64_t(b) + parts;
        const int64_t q_seq_per_hk = int64_t(s_q) * h_q;
        sizes_out[0] = int64_t(parts) * int64_t(sizeof(DecodingSchedMeta));
        sizes_out[1] = (int64_t(b) + 1) * int64_t(sizeof(int));
        sizes_out[2] = total_num_splits * q_seq_per_hk * int64_t(sizeof(float));
        sizes_out[3] = total_num_splits * q_seq_per_hk * kHeadDimV * int64_t(sizeof(float));
        if (num_sm_parts_out) *num_sm_parts_out = parts;
    });
}

// Tile scheduler metadata + num_splits (FlashMLA computes these on the first flash_mla_with_kvcache call of a
// FlashMLASchedMeta and reuses them while shapes and cache_seqlens stay the same).
FLASHMLA_CAPI int flashmla_get_metadata(const void* seqlens_k, int b, int s_q, int num_sm_parts,
                                        void* tile_scheduler_metadata, void* num_splits, void* stream) {
    return guarded([&] {
        CAPI_REQUIRE(b > 0 && s_q > 0 && num_sm_parts > 0, "b, s_q, num_sm_parts must be positive");
        CAPI_REQUIRE(seqlens_k && tile_scheduler_metadata && num_splits, "null pointer");
        GetDecodeSchedMetaParams p = {
            b, s_q,
            64,      // block_size_n
            5,       // fixed_overhead_num_blocks
            -1, -1,  // topk, extra_topk: dense
            nullptr, nullptr,
            (int*)seqlens_k,
            (DecodingSchedMeta*)tile_scheduler_metadata,
            (int*)num_splits,
            num_sm_parts,
            (cudaStream_t)stream
        };
        smxx::decode::run_get_decoding_sched_meta_kernel(p);
    });
}

// Split-KV MLA forward + combine (FlashMLA's dense_decode_fwd after the metadata exists).
FLASHMLA_CAPI int flashmla_dense_decode(
    const void* q, int64_t q_stride_b, int64_t q_stride_s, int64_t q_stride_h,
    const void* kcache, int64_t k_stride_block, int64_t k_stride_row, int num_blocks,
    const void* block_table, int64_t block_table_stride_b,
    const void* seqlens_k,
    void* out, void* softmax_lse,
    const void* tile_scheduler_metadata, const void* num_splits, int num_sm_parts,
    void* lse_accum, void* o_accum,
    int b, int s_q, int h_q, int head_dim_k, int head_dim_v, int page_block_size,
    float softmax_scale, int is_causal, void* stream) {
    return guarded([&] {
        int major = 0, minor = 0, sms = 0;
        query_arch(&major, &minor, &sms);
        CAPI_REQUIRE(major == 9 && minor == 0, "Dense decode MLA is only supported on SM90a architecture");
        CAPI_REQUIRE(head_dim_k == kHeadDimK, "head_dim_k must be 576 (the compiled sm90 kernel's HEAD_DIM_K)");
        CAPI_REQUIRE(head_dim_v == kHeadDimV, "head_dim_v must be 512");
        CAPI_REQUIRE(page_block_size == kPageBlockSize, "page_block_size must be 64");
        CAPI_REQUIRE(b > 0 && s_q > 0 && h_q > 0 && num_blocks > 0, "b, s_q, h_q, num_blocks must be positive");
        CAPI_REQUIRE(num_sm_parts > 0 && num_sm_parts <= kMaxCombineSplits, "num_sm_parts must be in [1, 160]");
        CAPI_REQUIRE(num_sm_parts == compute_num_sm_parts(sms, s_q, h_q),
                     "num_sm_parts differs from FlashMLA's max(num_sms / ceil_div(s_q*h_q, 64), 1)");
        CAPI_REQUIRE(q && kcache && block_table && seqlens_k && out && softmax_lse && tile_scheduler_metadata &&
                     num_splits && lse_accum && o_accum, "null pointer");
        CAPI_REQUIRE(q_stride_s == int64_t(h_q) * q_stride_h,
                     "q needs stride(1) == h_q * stride(2) (FlashMLA views q as [b, s_q*h_q, 1, d])");
        // TMA: 16-byte aligned base addresses and strides
        CAPI_REQUIRE(aligned16(q) && aligned16(kcache) && aligned16(out), "q, kcache, out must be 16-byte aligned");
        CAPI_REQUIRE(q_stride_b % 8 == 0 && q_stride_h % 8 == 0 && k_stride_block % 8 == 0 && k_stride_row % 8 == 0,
                     "q / kcache strides must be multiples of 8 elements (16 bytes)");

        const int h_k = 1;  // MLA: one latent KV head
        if (s_q == 1) is_causal = 0;
        const int num_q_heads_per_hk = h_q / h_k;
        const int q_seq_per_hk = s_q * num_q_heads_per_hk;
        const int num_heads = h_k;

        DenseAttnDecodeParams params;
        params.b = b;
        params.s_q = s_q;
        params.q_seq_per_hk = q_seq_per_hk;
        params.seqlens_k_ptr = (int*)seqlens_k;
        params.h_q = h_q;
        params.h_k = h_k;
        params.num_blocks = num_blocks;
        params.q_head_per_hk = num_q_heads_per_hk;
        params.is_causal = is_causal != 0;
        params.d = head_dim_k;
        params.d_v = head_dim_v;
        params.scale_softmax = softmax_scale;
        params.scale_softmax_log2 = float(softmax_scale * M_LOG2E);
        params.q_ptr = (void*)q;
        params.k_ptr = (void*)kcache;
        params.o_ptr = out;
        params.softmax_lse_ptr = (float*)softmax_lse;
        // q viewed as [b, q_seq_per_hk, h_k, d]: (stride_b, stride_h, stride_h, 1) as torch gives for the view
        params.q_batch_stride = q_stride_b;
        params.q_row_stride = q_stride_h;
        params.q_head_stride = q_stride_h;
        // kcache [num_blocks, 64, 1, d]: the size-1 head dim has torch stride == row stride when contiguous
        params.k_batch_stride = k_stride_block;
        params.k_row_stride = k_stride_row;
        params.k_head_stride = k_stride_row;
        // out allocated as [b, h_k, q_seq_per_hk, d_v] contiguous
        params.o_batch_stride = int64_t(num_heads) * q_seq_per_hk * head_dim_v;
        params.o_row_stride = head_dim_v;
        params.o_head_stride = int64_t(q_seq_per_hk) * head_dim_v;

        params.block_table = (int*)block_table;
        params.block_table_batch_stride = block_table_stride_b;
        params.page_block_size = page_block_size;

        params.tile_scheduler_metadata_ptr = (DecodingSchedMeta*)tile_scheduler_metadata;
        params.num_sm_parts = num_sm_parts;
        params.num_splits_ptr = (int*)num_splits;

        params.total_num_splits = b + num_sm_parts;
        params.softmax_lseaccum_ptr = (float*)lse_accum;
        params.oaccum_ptr = (float*)o_accum;
        params.stream = (cudaStream_t)stream;

        sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(params);

        CombineParams combine_params = {
            b, s_q,
            h_q, head_dim_v,

            params.softmax_lse_ptr,
            params.o_ptr,
            num_heads * q_seq_per_hk, h_q,
            h_q * s_q * head_dim_v, h_q * head_dim_v, head_dim_v,

            params.softmax_lseaccum_ptr,
            params.oaccum_ptr,
            num_heads * q_seq_per_hk, h_q,
            h_q * s_q * head_dim_v, h_q * head_dim_v, head_dim_v,

            params.tile_scheduler_metadata_ptr,
            params.num_splits_ptr,
            params.num_sm_parts,

            nullptr,  // attn_sink
            (cudaStream_t)stream
        };
        smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(combine_params);
    });
}
