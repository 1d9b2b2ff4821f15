#!/usr/bin/env bash
# Builds libflashmla_dense.so: DeepSeek FlashMLA's sm90 dense MLA decode kernels plus our C API (capi.cu),
# for the optional FlashMLA backend of helixserve.kernels.mla_paged_attention.
#
#   deploy/flashmla/build.sh [--src DIR] [--out DIR] [--jobs N]
#
#   --src DIR   a FlashMLA checkout (commit 9241ae3) with its csrc/cutlass submodule filled; without it the
#               sources are cloned into OUT/src (needs network: github.com)
#   --out DIR   where libflashmla_dense.so goes (default ~/.cache/helixserve/flashmla, the path
#               helixserve looks at when HELIXSERVE_FLASHMLA_LIB is unset); objects go to OUT/build
#   --jobs N    parallel nvcc processes (default: the number of cores)
#   NVCC        the compiler (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc); CUDA >= 12.3
#
# FlashMLA (MIT) and CUTLASS (BSD-3-Clause) are fetched at build time, not vendored; their license files are
# copied next to the library. The nvcc flags are FlashMLA setup.py's for its sm90 build (minus
# --source-in-ptx: no PTX is kept), plus -fPIC, hidden visibility and a static CUDA runtime (libstdc++ and
# libgcc_s stay dynamic). About 2 minutes on 2 cores (nvcc 13.0), most of it the bf16 split-KV kernel.
set -euo pipefail

FLASHMLA_URL="${FLASHMLA_URL:-https://github.com/deepseek-ai/FlashMLA}"  # a mirror may stand in
FLASHMLA_COMMIT=9241ae3          # "Swap FlashMLA combine grid dimensions (#182)"
CUTLASS_COMMIT=147f5673d0c1      # the commit FlashMLA's csrc/cutlass submodule pins at FLASHMLA_COMMIT
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

SRC=""
OUT="${HOME}/.cache/helixserve/flashmla"
JOBS="$(nproc 2>/dev/null || echo 2)"
while [ $# -gt 0 ]; do
  case "$1" in
    --src) SRC="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[ -x "$NVCC" ] || { echo "build.sh: no nvcc at $NVCC (set NVCC)" >&2; exit 1; }
mkdir -p "$OUT/build"
OUT="$(cd "$OUT" && pwd)"

fetch_sources() {  # clone FlashMLA at FLASHMLA_COMMIT and its CUTLASS submodule into $1
  local dir="$1"
  if [ ! -d "$dir/.git" ]; then
    git clone --filter=blob:none "$FLASHMLA_URL" "$dir"
  fi
  git -C "$dir" checkout --quiet "$FLASHMLA_COMMIT"
  git -C "$dir" submodule update --init --depth 1 csrc/cutlass \
    || git -C "$dir" submodule update --init csrc/cutlass
}

if [ -z "$SRC" ]; then
  SRC="$OUT/src"
  echo "== fetching FlashMLA $FLASHMLA_COMMIT into $SRC"
  fetch_sources "$SRC"
fi
[ -d "$SRC" ] || { echo "build.sh: --src $SRC is not a directory" >&2; exit 1; }
SRC="$(cd "$SRC" && pwd)"
S="$SRC/csrc"
for f in utils.h params.h sm90/decode/dense/instantiations/bf16.cu smxx/decode/combine/combine.cu \
         smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu cutlass/include/cutlass/cutlass.h; do
  [ -f "$S/$f" ] || { echo "build.sh: $S/$f missing (a FlashMLA $FLASHMLA_COMMIT checkout with csrc/cutlass filled?)" >&2; exit 1; }
done
check_commit() {  # DIR WANTED: warn when DIR is its own git checkout at another commit
  local top head
  top="$(git -C "$1" rev-parse --show-toplevel 2>/dev/null)" || return 0
  [ "$(cd "$top" && pwd -P)" = "$(cd "$1" && pwd -P)" ] || return 0  # a plain directory inside another repo
  head="$(git -C "$1" rev-parse HEAD)"
  case "$head" in "$2"*) ;; *) echo "build.sh: warning: $1 is at $head, not $2" >&2 ;; esac
}
check_commit "$SRC" "$FLASHMLA_COMMIT"
check_commit "$S/cutlass" "$CUTLASS_COMMIT"

FLAGS=(-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -Wno-deprecated-declarations
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
  -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
  --ptxas-options=-v,--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage,--warn-on-double-precision-use
  -lineinfo -gencode arch=compute_90a,code=sm_90a --threads "${NVCC_THREADS:-1}"
  -Xcompiler -fPIC -Xcompiler -fvisibility=hidden
  -I"$HERE/shim" -I"$S" -I"$S/kerutils/include" -I"$S/sm90" -I"$S/cutlass/include" -I"$S/cutlass/tools/util/include")

B="$OUT/build"
# objects are reused only when built by the same compiler, flags and sources directory
stamp="$("$NVCC" --version | tail -n 1) ${FLAGS[*]}"
if [ "$(cat "$B/stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -f "$B"/*.o
  printf '%s' "$stamp" >"$B/stamp"
fi
SOURCES=("$S/sm90/decode/dense/instantiations/bf16.cu:dense_bf16"  # the slow one first
         "$S/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu:sched_meta"
         "$S/smxx/decode/combine/combine.cu:combine"
         "$HERE/capi.cu:capi")

compile() {  # SRC_FILE NAME: $B/NAME.o unless it is newer than its source and the shim; log in $B/NAME.log
  local src="$1" obj="$B/$2.o"
  if [ -f "$obj" ] && [ "$obj" -nt "$src" ] && [ "$obj" -nt "$HERE/shim/utils.h" ]; then
    echo "   $2.o up to date"; return 0
  fi
  local start=$SECONDS
  echo "== $(date +%T) compiling $(basename "$src") -> $2.o"
  if "$NVCC" "${FLAGS[@]}" -c "$src" -o "$obj.tmp" >"$B/$2.log" 2>&1; then
    mv "$obj.tmp" "$obj"
    echo "   $2.o: $((SECONDS - start)) s"
  else
    echo "build.sh: compiling $src failed; its log ($B/$2.log) ends:" >&2; tail -n 30 "$B/$2.log" >&2
    return 1
  fi
}

start=$SECONDS
pids=()
for entry in "${SOURCES[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  compile "${entry%%:*}" "${entry##*:}" &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
[ "$failed" = 0 ] || { echo "build.sh: compilation failed" >&2; exit 1; }

echo "== $(date +%T) linking $OUT/libflashmla_dense.so"
"$NVCC" -shared -gencode arch=compute_90a,code=sm_90a -cudart static -Xlinker --exclude-libs,ALL \
  "$B/sched_meta.o" "$B/combine.o" "$B/dense_bf16.o" "$B/capi.o" -o "$OUT/libflashmla_dense.so.tmp"
mv "$OUT/libflashmla_dense.so.tmp" "$OUT/libflashmla_dense.so"
cp "$SRC/LICENSE" "$OUT/LICENSE.FlashMLA"
[ -f "$S/cutlass/LICENSE.txt" ] && cp "$S/cutlass/LICENSE.txt" "$OUT/LICENSE.cutlass"
missing="$(for f in flashmla_capi_version flashmla_last_error flashmla_set_device flashmla_num_sms \
                    flashmla_workspace_sizes flashmla_get_metadata flashmla_dense_decode; do
             nm -D --defined-only "$OUT/libflashmla_dense.so" | grep -qw "$f" || echo "$f"; done)"
[ -z "$missing" ] || { echo "build.sh: the library lacks $missing" >&2; exit 1; }
echo "== $(date +%T) done in $((SECONDS - start)) s: $OUT/libflashmla_dense.so (set HELIXSERVE_FLASHMLA_LIB to use it from elsewhere)"
