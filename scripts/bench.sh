#!/usr/bin/env bash
# Measures the performance figures of README.md and docs/benchmarks.md on a GPU machine in one
# run, from the repository and prebuilt binaries alone (no Rust toolchain, no network), each
# beside its baseline in the same run, and writes them as a markdown table.
#
# Usage: scripts/bench.sh [--bin DIR] [--base DIR] [--base-kernels SPEC] [--out DIR]
#                         [--items LIST] [--torch-llama FILE] [--tokenizer FILE] [--gpu N]
#                         [--dry-run] [--help]
#
#   --bin DIR           the binaries to measure: llama2_train, kernel_bench, flash_check, and
#                       for their items gpt_train and collective_bench, each plain or gzipped
#                       (NAME.gz); default $BIN, else target/release/examples
#   --base DIR          a baseline build of the same binaries: each smp-burn run is repeated
#                       with it right after the measured build's, so both see the same machine
#   --base-kernels SPEC run the baseline with SMP_BURN_KERNELS=SPEC (e.g. `deterministic`);
#                       without --base the baseline is then the measured binaries themselves
#   --out DIR           where bench.md, bench.log and logs/ go; default $OUT, else ./bench-out
#   --items LIST        comma-separated items (below); default $ITEMS, else
#                       kernels,gemm,1b,7b,torch,gpt
#   --torch-llama FILE  the PyTorch reference trainer; default scripts/torch_llama.py
#   --tokenizer FILE    a tokenizer.json to use instead of training the 2,048-token one
#   --gpu N             the GPU of the single-GPU runs (default 0)
#   --dry-run           print what would run and exit (needs no GPU and no binaries)
#
# Items, with rough wall times on one H200 (estimates: the first smp-burn run on a fresh
# machine also compiles its kernels into the cache, about a minute more):
#   check    kernel_bench check: every fast path against its reference op           1-2 min
#   kernels  flash_check's benchmark of every attention kernel the GPU runs, hd 128 and
#            64, B8 S=4096 and B2 S=16384, beside PyTorch's SDPA flash backend
#            (scripts/torch_attn.py)                                                ~1-2 min
#   gemm     kernel_bench gemm (ours, cuBLAS direct) beside scripts/torch_gemm.py    ~1 min
#   1b       llama2_train --model 1b, 12 steps, median of steps 4-11                 ~40 s
#   7b       llama2_train --model 7b, 9 steps, median of steps 3-9                   ~1 min
#   torch    scripts/torch_llama.py, eager and --compile, right after each of 1b and
#            7b (both models when neither is asked for)                              ~3-4 min
#   gpt      gpt_train (86M GPT-2) on CudaCube and on burn::backend::Cuda (fusion)   ~1 min
#   coll     collective_bench beside scripts/torch_coll.py on every visible GPU
#            (2 or more; not in the default list)                                   ~2 min
#   packed   llama2_train --model 7b at S=32,768, all 32 layers recomputed
#            selectively, on the corpus cut into documents of about 256-16k tokens,
#            with --document-masking and without (the same rows causal); steps 2-4
#            (not in the default list)                                              ~8 min
# The default items: about 8-9 minutes in all (an estimate from the runs they replace, not yet
# timed end to end; logs/runs.tsv records each run's time).
# --base repeats the smp-burn runs (all items but torch). To stay within a time limit, split
# the items over several runs; bench.md is rewritten after each item, so a run cut short
# keeps what it measured.
#
# The runs share one kernel cache ($KERNEL_CACHE, default /tmp/kc: SMP_BURN_KERNELS=cache_dir=...,
# one folder per build inside it) and one work folder ($BENCH_WORK, default /tmp/smp-bench: the
# corpus unpacked and the tokenizer, kept for the next run on the same machine).
#
# Example, a new build beside the previous one, binaries (gzipped or not) in new/ and old/:
#   scripts/bench.sh --bin new --base old --items 1b,7b --out "$OUT"

set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
ALL_ITEMS=(check kernels gemm 1b 7b torch gpt coll packed)

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

BIN=${BIN:-$REPO/target/release/examples}
BASE=${BASE:-}
BASE_KERNELS=${BASE_KERNELS:-}
OUT=${OUT:-$PWD/bench-out}
ITEMS=${ITEMS:-kernels,gemm,1b,7b,torch,gpt}
TORCH_LLAMA=${TORCH_LLAMA:-$HERE/torch_llama.py}
TOKENIZER=${TOKENIZER:-}
GPU=${GPU:-0}
DRY=0
KERNEL_CACHE=${KERNEL_CACHE:-/tmp/kc}
WORK=${BENCH_WORK:-/tmp/smp-bench}
ARGS=("$@")

value() { [[ $# -ge 2 && $2 != --* ]] || { echo "bench.sh: $1 needs a value" >&2; exit 2; }; }
while (($#)); do
  case $1 in
    --bin) value "$@"; BIN=$2; shift 2 ;;
    --base) value "$@"; BASE=$2; shift 2 ;;
    --base-kernels) value "$@"; BASE_KERNELS=$2; shift 2 ;;
    --out) value "$@"; OUT=$2; shift 2 ;;
    --items) value "$@"; ITEMS=$2; shift 2 ;;
    --torch-llama) value "$@"; TORCH_LLAMA=$2; shift 2 ;;
    --tokenizer) value "$@"; TOKENIZER=$2; shift 2 ;;
    --gpu) value "$@"; GPU=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "bench.sh: unknown argument ${1@Q}" >&2; usage >&2; exit 2 ;;
  esac
done

# Steps of the Llama runs and the window whose median counts (the first steps compile kernels;
# these are the windows of the published figures).
STEPS_1B=${STEPS_1B:-12} FIRST_1B=${FIRST_1B:-4} LAST_1B=${LAST_1B:-11}
STEPS_7B=${STEPS_7B:-9} FIRST_7B=${FIRST_7B:-3} LAST_7B=${LAST_7B:-9}

declare -A WANT=()
IFS=, read -ra asked <<< "$ITEMS"
for i in "${asked[@]}"; do
  [[ " ${ALL_ITEMS[*]} " == *" $i "* ]] || {
    echo "bench.sh: unknown item ${i@Q}; items: ${ALL_ITEMS[*]}" >&2
    exit 2
  }
  WANT[$i]=1
done
wants() { [[ -n ${WANT[$1]:-} ]]; }

abs() { realpath -m -- "$1"; }
BIN=$(abs "$BIN")
[[ -n $BASE ]] && BASE=$(abs "$BASE")
OUT=$(abs "$OUT")
TORCH_LLAMA=$(abs "$TORCH_LLAMA")
[[ -n $TOKENIZER ]] && TOKENIZER=$(abs "$TOKENIZER")
LOGS=$OUT/logs

# Builds: `new` always; `base` with --base or --base-kernels.
BUILDS=(new)
declare -A SRC=([new]=$BIN) SPEC=()
KERNELS_NEW="${SMP_BURN_KERNELS:+$SMP_BURN_KERNELS,}cache_dir=$KERNEL_CACHE"
SPEC[new]=$KERNELS_NEW
if [[ -n $BASE || -n $BASE_KERNELS ]]; then
  BUILDS+=(base)
  SRC[base]=${BASE:-$BIN}
  SPEC[base]=${BASE_KERNELS:+$BASE_KERNELS,}cache_dir=$KERNEL_CACHE
  [[ -z $BASE_KERNELS ]] && SPEC[base]=$KERNELS_NEW
fi

stamp() { echo "=== $(date +%T) $*"; }

# run TAG LIMIT_S [with BUILD] [on_all_gpus] CMD...: CMD's output to logs/TAG.log, its exit
# status and wall time to logs/runs.tsv. `with BUILD` runs it with that build's kernel settings,
# `on_all_gpus` with every GPU that was visible when the script started.
run() {
  local tag=$1 limit=$2 pre=()
  shift 2
  while :; do
    case $1 in
      with) pre+=(env "SMP_BURN_KERNELS=${SPEC[$2]}"); shift 2 ;;
      on_all_gpus)
        if [[ -n $ALL_GPUS ]]; then pre+=(env "CUDA_VISIBLE_DEVICES=$ALL_GPUS"); else pre+=(env -u CUDA_VISIBLE_DEVICES); fi
        shift ;;
      *) break ;;
    esac
  done
  stamp "$tag: ${pre[*]}${pre[*]:+ }$*"
  ((DRY)) && return 0
  local t0=$SECONDS rc=0
  timeout -s KILL "$limit" "${pre[@]}" "$@" > "$LOGS/$tag.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\n' "$tag" "$rc" "$((SECONDS - t0))" >> "$LOGS/runs.tsv"
  if ((rc != 0)); then
    echo "    exit status $rc$( ((rc == 137)) && echo " (killed at its ${limit} s limit)"); last lines:"
    tail -n 5 "$LOGS/$tag.log" | cut -c1-200 | sed 's/^/    /'
  fi
  return 0
}

# The binary NAME of build B (unpacked into the work folder), or nothing if the build lacks it.
bin() {
  local b=$1 name=$2
  if ((DRY)); then echo "${SRC[$b]}/$name"; return; fi
  [[ -x $WORK/bin-$b/$name ]] && echo "$WORK/bin-$b/$name"
}

# Whether build B has binary NAME; says so once when it does not.
has() {
  local b=$1 name=$2
  ((DRY)) && return 0
  [[ -n $(bin "$b" "$name") ]] && return 0
  echo "    skipped: no $name in ${SRC[$b]} (build $b)"
  return 1
}

have_torch() {
  ((DRY)) && return 0
  python3 -c "import torch" 2>/dev/null && return 0
  echo "    skipped: python3 cannot import torch"
  return 1
}

table() {
  ((DRY)) && return 0
  python3 "$HERE/bench_table.py" "$LOGS" --window "1b=$FIRST_1B:$LAST_1B" \
    --window "7b=$FIRST_7B:$LAST_7B" --window "7b32k-rows=2:4" --window "7b32k-docs=2:4" \
    --out "$OUT/bench.md" > /dev/null ||
    echo "    bench_table.py failed; the logs are in $LOGS"
}

setup() {
  mkdir -p "$OUT" "$LOGS" "$WORK" "$KERNEL_CACHE"
  : > "$LOGS/runs.tsv"
  {
    echo "\`scripts/bench.sh ${ARGS[*]}\` ($(date -u '+%F %H:%M UTC'))"
  } > "$LOGS/command.txt"
  # The binaries load the CUDA libraries at run time: point the loader at wherever this
  # machine keeps them (CUDA toolkit, pip's nvidia-* wheels, ...).
  local l d
  for l in libnvrtc.so libcublasLt.so libcublas.so libnccl.so; do
    d=$(find / -name "$l*" -not -path '/proc/*' -not -path '/sys/*' 2>/dev/null | grep -v stubs | head -1)
    [[ -n $d ]] && export LD_LIBRARY_PATH=$(dirname "$d")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  {
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1 |
      sed -n "$((GPU + 1))p"
    python3 -c "import torch, transformers; print('torch', torch.__version__, '/ transformers', transformers.__version__)" 2>/dev/null
  } > "$LOGS/gpu.txt"
  cat "$LOGS/gpu.txt"
  local b n src dst
  : > "$LOGS/builds.txt"
  for b in "${BUILDS[@]}"; do
    src=${SRC[$b]} dst=$WORK/bin-$b
    rm -rf "$dst" && mkdir -p "$dst"
    for n in llama2_train kernel_bench flash_check gpt_train collective_bench; do
      if [[ -f $src/$n.gz ]]; then
        gunzip -c "$src/$n.gz" > "$dst/$n" && chmod +x "$dst/$n"
      elif [[ -f $src/$n ]]; then
        cp "$src/$n" "$dst/$n" && chmod +x "$dst/$n"
      fi
    done
    echo "$b: $src ($(cd "$dst" && ls | paste -sd ' ' -)), llama2_train sha256 $(sha256sum "$dst/llama2_train" 2>/dev/null | cut -c1-12), SMP_BURN_KERNELS=${SPEC[$b]}" >> "$LOGS/builds.txt"
  done
  cat "$LOGS/builds.txt"
  [[ -x $WORK/bin-new/llama2_train ]] || {
    echo "bench.sh: no llama2_train in $BIN (see --bin)" >&2
    exit 1
  }
  # The corpus, and the 2,048-token BPE a one-step CPU run trains on it and saves with its
  # checkpoint (the models keep Llama 2's 32,000-entry vocabulary either way).
  [[ -s $WORK/shakespeare.txt ]] || gunzip -c "$REPO/data/shakespeare.txt.gz" > "$WORK/shakespeare.txt"
  if [[ -z $TOKENIZER ]]; then
    TOKENIZER=$WORK/tok2048.json
    if [[ ! -s $TOKENIZER ]]; then
      rm -rf "$WORK/tok"
      run tokenizer 300 "$WORK/bin-new/llama2_train" --model tiny --steps 1 --vocab-size 2048 \
        --data "$WORK/shakespeare.txt" --out-dir "$WORK/tok" --eval-interval 0 --export-hf none \
        --sample none --seq-len 64 --micro-batch 1 --no-progress
      cp "$WORK/tok/checkpoints/step-000001/tokenizer.json" "$TOKENIZER" || {
        echo "bench.sh: the tokenizer run wrote no tokenizer.json (logs/tokenizer.log)" >&2
        exit 1
      }
    fi
  fi
}

item_check() {
  local b
  for b in "${BUILDS[@]}"; do
    has "$b" kernel_bench && run "check-$b" 400 with "$b" "$(bin "$b" kernel_bench)" check
  done
}

# Flash attention at the shapes of PyTorch's own attention micro-benchmark (the same tokens per
# call: B8 S=4096, B2 S=16384), every kernel this device runs. $ATTN_SHAPES (BATCHxSEQ ...)
# and $ATTN_FLAGS (added to flash_check's `--head-dim D --seq S --batch B`) change them.
read -ra ATTN_SHAPES <<< "${ATTN_SHAPES:-8x4096 2x16384}"
read -ra ATTN_FLAGS <<< "${ATTN_FLAGS:---no-check}"
item_kernels() {
  local b d shape
  for b in "${BUILDS[@]}"; do
    has "$b" flash_check || continue
    for d in 128 64; do
      for shape in "${ATTN_SHAPES[@]}"; do
        run "attn-$b-hd$d-B${shape%x*}-S${shape#*x}" 180 with "$b" "$(bin "$b" flash_check)" \
          "${ATTN_FLAGS[@]}" --head-dim "$d" --seq "${shape#*x}" --batch "${shape%x*}"
      done
    done
  done
  have_torch &&
    run attn-torch 180 python3 "$HERE/torch_attn.py" --batch micro --lens 4096,16384 --head-dims 128,64
}

item_gemm() {
  local b
  for b in "${BUILDS[@]}"; do
    has "$b" kernel_bench && run "gemm-$b" 200 with "$b" "$(bin "$b" kernel_bench)" gemm
  done
  have_torch && run gemm-torch 120 python3 "$HERE/torch_gemm.py"
}

torch_llama() {
  local m=$1 steps=10 limit=200
  [[ $m == 7b ]] && steps=8 limit=300
  ((DRY)) || python3 -c "import torch, transformers" 2>/dev/null || {
    echo "    skipped: python3 cannot import torch and transformers"
    return
  }
  run "torch-$m-eager" "$limit" python3 "$TORCH_LLAMA" --preset "$m" --steps "$steps"
  run "torch-$m-compile" $((limit + 200)) python3 "$TORCH_LLAMA" --preset "$m" --steps "$steps" --compile
}

item_llama() {
  local m=$1 b steps limit dir
  case $m in
    1b) steps=$STEPS_1B limit=240 ;;
    7b) steps=$STEPS_7B limit=360 ;;
  esac
  for b in "${BUILDS[@]}"; do
    has "$b" llama2_train || continue
    dir=$WORK/run-$m-$b
    rm -rf "$dir"
    run "llama-$m-$b" "$limit" with "$b" "$(bin "$b" llama2_train)" --device cuda --nproc-per-node 1 \
      --model "$m" --steps "$steps" --eval-interval 0 --no-checkpoint --export-hf none \
      --sample none --no-progress --tokenizer "$TOKENIZER" --data "$WORK/shakespeare.txt" \
      --seq-len 4096 --micro-batch 1 --out-dir "$dir"
    ((DRY)) || cp "$dir/metrics.jsonl" "$LOGS/llama-$m-$b.metrics.jsonl" 2>/dev/null
  done
  # PyTorch right after ours, so that both see the machine in the same state.
  wants torch && torch_llama "$m"
}

item_gpt() {
  local b k
  for b in "${BUILDS[@]}"; do
    has "$b" gpt_train || continue
    for k in cube fusion; do
      run "gpt-$b-$k" 240 with "$b" "$(bin "$b" gpt_train)" --device cuda --backend "$k" --ranks 1 \
        --layers 12 --d-model 768 --heads 12 --seq-len 1024 --micro-batch 8 --steps 60
    done
  done
}

item_coll() {
  local b n=2
  ((DRY)) || n=$(tr ',' '\n' <<< "$ALL_GPUS" | grep -c .)
  ((DRY)) || [[ -n $ALL_GPUS ]] || n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  ((n >= 2)) || { echo "    skipped: coll needs 2 or more GPUs, this machine shows $n"; return; }
  for b in "${BUILDS[@]}"; do
    has "$b" collective_bench &&
      run "coll-$b" 400 with "$b" on_all_gpus "$(bin "$b" collective_bench)" --no-overlap
  done
  have_torch && run coll-torch 400 on_all_gpus \
    python3 -m torch.distributed.run --nproc-per-node "$n" "$HERE/torch_coll.py"
}

# The corpus as JSONL documents of log-uniform length, 800 to 50,000 characters (about 256 to
# 16k tokens of the 2,048-token BPE), in order, with a fixed seed: about 12 documents per
# 32,768-token row.
make_documents() {
  ((DRY)) && return 0
  [[ -s $WORK/documents.jsonl ]] && return 0
  python3 - "$WORK/shakespeare.txt" "$WORK/documents.jsonl" << 'PY'
import json, math, random, sys
text = open(sys.argv[1]).read()
rng = random.Random(0)
with open(sys.argv[2], "w") as out:
    pos = 0
    while pos < len(text):
        n = int(math.exp(rng.uniform(math.log(800), math.log(50000))))
        out.write(json.dumps({"text": text[pos:pos + n]}) + "\n")
        pos += n
PY
}

item_packed() {
  local b mode dir masking
  make_documents
  for b in "${BUILDS[@]}"; do
    has "$b" llama2_train || continue
    for mode in rows docs; do
      masking=()
      [[ $mode == docs ]] && masking=(--document-masking)
      dir=$WORK/run-7b32k-$mode-$b
      rm -rf "$dir"
      run "llama-7b32k-$mode-$b" 480 with "$b" "$(bin "$b" llama2_train)" --device cuda \
        --nproc-per-node 1 --model 7b --steps 4 --eval-interval 0 --no-checkpoint \
        --export-hf none --sample none --no-progress --tokenizer "$TOKENIZER" \
        --data "$WORK/documents.jsonl" --seq-len 32768 --micro-batch 1 \
        --global-batch-tokens 32768 --selective-recompute --checkpointed-layers 32 \
        "${masking[@]}" --out-dir "$dir"
      ((DRY)) || cp "$dir/metrics.jsonl" "$LOGS/llama-7b32k-$mode-$b.metrics.jsonl" 2>/dev/null
    done
  done
}

# The single-GPU runs see one GPU; `coll` sees every GPU that was visible to begin with.
ALL_GPUS=${CUDA_VISIBLE_DEVICES:-}
if [[ -z $ALL_GPUS ]] && ((!DRY)) && command -v nvidia-smi > /dev/null; then
  ALL_GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd, -)
fi
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  export CUDA_VISIBLE_DEVICES=${visible[$GPU]:-$GPU}
else
  export CUDA_VISIBLE_DEVICES=$GPU
fi

if ((DRY)); then
  echo "dry run: builds ${BUILDS[*]}; binaries from ${SRC[new]}${BASE:+ and $BASE}; out $OUT"
  TOKENIZER=${TOKENIZER:-$WORK/tok2048.json}
else
  mkdir -p "$OUT"
  exec > >(tee "$OUT/bench.log") 2>&1
  setup
fi

for item in "${ALL_ITEMS[@]}"; do
  wants "$item" || continue
  case $item in
    check) item_check ;;
    kernels) item_kernels ;;
    gemm) item_gemm ;;
    1b | 7b) item_llama "$item" ;;
    torch) wants 1b || wants 7b || { torch_llama 1b; torch_llama 7b; } ;;
    gpt) item_gpt ;;
    coll) item_coll ;;
    packed) item_packed ;;
  esac
  table
done

stamp done
if ((!DRY)); then
  echo
  cat "$OUT/bench.md"
fi
