#!/usr/bin/env bash
# Runs mambalab's GPU work on a lent GPU machine without network: installs the carried wheels, compiles mamba-ssm's
# CUDA extension (the rival) in the background, then runs each STEP given, in order.
#   usage:    [STEP_TIMEOUT=300] [DTYPES="bf16 fp32"] [OUT=build/gpu] [SKIP_EXT=1] bash benchmarks/gpu_run.sh STEP...
#   settings: STEP_TIMEOUT  seconds each step may run, all its commands together, not counting the wait for a build
#             DTYPES        the SSD benchmarks' dtypes (each step's default is in the table)
#             OUT           where each step's log ($OUT/STEP.log) and results go; the device tool exports an OUT of its
#                           own (what comes back): there pass OUT=build/gpu PACK=$OUT
#             SKIP_EXT=1    no extension build (gpu_lanes.sh's later lanes: the first lane builds it)
#             MAMBALAB_COMMIT  the commit measured, recorded in every JSON's environment (the device tool sends the
#                           working tree without .git: write out git rev-parse --short HEAD's answer in the command)
#             PACK          a folder that receives, after each step, OUT's logs and results as one results.tgz
#                           (no .pt files) and compat's parts: the device tool's $OUT, which brings back 8 files
#   carried:  .whl/ (mamba-ssm's wheel built with MAMBA_SKIP_CUDA_BUILD=TRUE; papermill, plotly, ipywidgets,
#             ipykernel, nbconvert and their missing dependencies), .carry/ (mamba-ssm's sdist; causal-conv1d's for
#             ccd-ext and transformers' wheels for compat: benchmarks/carry_compat.sh; TileLang's for tilelang-a and
#             -b: benchmarks/tilelang_wheels.sh)
# Steps (* waits for mamba-ssm's CUDA extension; GPU-only tests are those marked gpu, see tests/test_gpu_marker.py):
#   gpu-tests*          every GPU-only test (pytest -m gpu tests)
#   ssd-tests           the GPU-only SSD tests (tests/test_ssd_*.py, test_state_sweep.py)
#   mamba3-tests        the GPU-only Mamba-3 tests (tests/test_mamba3_*.py; against mamba-ssm's MIMO after tilelang-b)
#   decode-tests        the GPU-only decode-kernel tests (state update, conv update, gated norm)
#   compat-tests*       the drop-ins' and norms' GPU-only tests; upstream's test_mamba_inner_fn, causal-conv1d and gated-norm
#                       tests at their sizes (needs ccd-ext earlier)
#   compat-upstream*    upstream's tests of compat-tests alone, 8 pytest workers when .whl has pytest-xdist
#                       (../shared/gpu-wheels.sh latex2mathml pytest-xdist execnet; needs ccd-ext earlier)
#   tests*              all of test_selective_scan.py and test_mamba1.py, then the former's GPU-only tests again
#   det-tests           all of the determinism tests, then benchmarks/fingerprints.py
#   gen-tests           all of test_generate.py
#   upstream            mamba-ssm's own tests, ported (tests/upstream), at upstream's sizes
#   notebooks*          every chapter at its GPU size (mambalab workbook)
#   nb-NN               chapter NN at its GPU size (nb-01 waits for the extension, nb-05 for ccd-ext's build)
#   bench*              bench_selective_scan.py against selective_scan_fn, with the tile sweep
#   bench-nosweep*      the same without the sweep
#   ssd-bench           bench_ssd.py against mamba_chunk_scan_combined: deterministic mode, then default (bf16 fp32)
#   ssd-sweep           mambalab's SSD tile configurations beside mamba-ssm's deterministic mode (bf16 fp32)
#   ssd-fwd-sweep       each SSD kernel alone over its tiles, forward and backward (fp32)
#   ssd-varlen-bench    8 packed sequences against mamba_chunk_scan_combined with seq_idx (bf16 fp32)
#   ssd-varlen-profile  the same with each side's kernels profiled (bf16)
#   tilelang-a          install TileLang (carry .carry/tilelang-a alone: the wheels exceed one call's carry limit)
#   tilelang-b          then its dependencies (the next call, machine still warm: .carry/tilelang-b and .whl)
#   mamba3-bench        bench_mamba3.py against mamba3_siso_combined, and mamba3_mimo once tilelang-b imports
#   mamba3-blocks       whole Mamba3 blocks at d_model 1024 and 2048 against mamba-ssm's (MIMO too after tilelang-b)
#   decode-b64          the Mamba-3 decode step at batch 64: time and bandwidth (bench_mamba3.py decode)
#   decode-kernel       its kernel's own rate over 8 layers' states (bench_mamba3.py step-kernel-rates)
#   decode-sweep        its tile choices (bench_mamba3.py step-sweep)
#   decode-regs         its register cap (bench_mamba3.py step-register-sweep)
#   decode-ncu          Nsight Compute on its kernel at r = 1 and 4 (bench_mamba3.py step-launches)
#   profile-decode*     one decode step's kernels as CUDA graphs, mambalab against mamba-ssm, batch 1
#   profile-decode-CONFIG  the same for one configuration of bench_generation.py (mamba-* waits for the extension)
#   generation*         bench_generation.py against mamba-ssm's generate: mamba2-130m, mamba2-2.7b, then mamba-130m
#   generation-CONFIG   one of those configurations (generation-mamba-130m waits for the extension)
#   train-step          bench_train_step.py: a training step of mamba2-2.7b's shape, 2,048 to 8,192 tokens
#   tp-bench            bench_tp.py: TP = 1 on one GPU, TP = 2 on two
#   ccd-ext             build the causal_conv1d package in the background (compat-tests and compat need it)
#   compat*             mamba-ssm's and transformers' models routed onto mambalab (bench_compat.py): fingerprints in
#                       both mamba-ssm modes and their GPU tests (needs ccd-ext earlier, .carry/transformers)
#   compat-routed       the routed fingerprints alone (bench_compat.py fingerprints --routed-only): what comparing two
#                       GPUs needs, mamba-ssm's own kernels not run (no extension build waited for; ccd-ext earlier)
#   compat-speed*       bench_compat.py speed, routed against mamba-ssm in each of its modes (needs ccd-ext earlier)
#   compat-profile*     bench_compat.py profile: that step's operators and kernels, mamba-ssm's deterministic mode
#   compat-profile-routed*  the routed step's alone (bench_compat.py profile --routed-only; no ccd-ext needed)
#   conv-bench*         bench_conv.py: the conv's kernels at the routed step's shape, against the causal_conv1d package
#                       (needs ccd-ext earlier); CONV_CANDIDATES="FILE[:NAME=V,...] ..." times kernels under development
set -uo pipefail
OUT=${OUT:-build/gpu}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
case $STEP_TIMEOUT in ''|*[!0-9]*) echo "STEP_TIMEOUT: whole seconds expected, got '$STEP_TIMEOUT'" >&2; exit 2 ;; esac
if [ -n "${PACK:-}" ] && [ "$(realpath -m "$OUT")" = "$(realpath -m "$PACK")" ]; then
  # the device tool exports OUT as the folder that comes back (8 files at most): logs and .pt files would crowd
  # out results.tgz there
  echo "OUT and PACK are the same folder ($OUT): set OUT=build/gpu (the device tool exports OUT)" >&2; exit 2
fi
mkdir -p "$OUT"
COMPAT_UPSTREAM=(tests/upstream/test_selective_scan.py::test_mamba_inner_fn tests/upstream/test_causal_conv1d.py
                 tests/upstream/test_layernorm_gated.py)
if [ ! -f /tmp/site/.mambalab-wheels ] && [ -d .whl ]; then   # once per machine (parallel lanes share it); a call
  # that carries no .whl (tilelang-a) installs nothing here
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.mambalab-wheels || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/tlsite ] && export PYTHONPATH=/tmp/tlsite:$PYTHONPATH   # TileLang, when tilelang-a/-b installed it
if [ -d .carry/transformers ] && [ ! -d /tmp/tfsite ]; then   # transformers as the project pins it (the image's is older)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tfsite .carry/transformers/*.whl
fi
[ -d /tmp/tfsite ] && export PYTHONPATH=/tmp/tfsite:$PYTHONPATH HF_HUB_OFFLINE=1
export JUPYTER_PATH=/tmp/site/share/jupyter   # nbconvert's templates, installed with --target
SDIST=$(ls .carry/mamba_ssm-*.tar.gz)
EXT_DIR=/tmp/mamba_ext
nvidia-smi -L
if [ "${SKIP_EXT:-0}" = 1 ]; then
  echo "extension build skipped (SKIP_EXT=1)" >"$OUT/ext_build.log"; build_pid=
else
  (python3 benchmarks/mamba_cuda_ext.py "$SDIST" "$EXT_DIR" >"$OUT/ext_build.log" 2>&1; echo "ext build rc=$?" >>"$OUT/ext_build.log") &
  build_pid=$!
fi
on_path() { case ":$PYTHONPATH:" in *":$1:"*) ;; *) export PYTHONPATH=$PYTHONPATH:$1 ;; esac; }
# The step's clock starts again once what it waited for is built.
ext_ready() { [ -n "$build_pid" ] && wait "$build_pid" 2>/dev/null; on_path "$EXT_DIR"; step_end=$((SECONDS + STEP_TIMEOUT)); }
ccd_built() { [ -n "${ccd_pid:-}" ] && wait "$ccd_pid" 2>/dev/null; on_path /tmp/ccd_ext
              step_end=$((SECONDS + STEP_TIMEOUT)); }
ccd_ready() { ext_ready; ccd_built; }
# compat's folder (JSON and the routed steps' .pt files) in parts small enough to come back from the device
# machine (16 MiB a file)
pack_compat() { tar czf - -C "$OUT" --exclude='*_own_*' compat | split -b 15M - "$OUT/compat.tar.gz.part-"; }
# "$@" within what is left of this step's STEP_TIMEOUT (status 124, as timeout's, when it is spent)
within() {
  local left=$((step_end - SECONDS))
  if [ "$left" -le 0 ]; then echo "STEP_TIMEOUT ($STEP_TIMEOUT s) spent, not run: $*" >>"$log"; return 124; fi
  timeout "$left" "$@"; local rc=$?
  [ "$rc" = 124 ] && echo "stopped at STEP_TIMEOUT ($STEP_TIMEOUT s): $*" >>"$log"
  return "$rc"
}
run_pytest() { within python3 -m pytest -p no:cacheprovider -rs "$@" >>"$log" 2>&1; }   # into the step's log
for step in "$@"; do
  echo "=== $step $(date +%T)"
  # Each step logs to $OUT/<step>.log as it goes, so a run cut short still says how far it got; `show` picks the
  # lines printed at its end (else its last 6).
  log=$OUT/$step.log; : >"$log"; show=; step_end=$((SECONDS + STEP_TIMEOUT))
  case $step in
    gpu-tests) ext_ready; run_pytest -v -m gpu tests ;;
    ssd-tests) run_pytest -q -m gpu tests/test_ssd_*.py tests/test_state_sweep.py ;;
    mamba3-tests) run_pytest -q -m gpu tests/test_mamba3_*.py ;;
    decode-tests) run_pytest -q -m gpu tests/test_state_update.py tests/test_conv_update.py tests/test_norm_kernel.py ;;
    compat-tests) ccd_ready
                  run_pytest -q -m gpu tests/test_layer_norm_fn.py tests/test_causal_conv1d_fn.py tests/test_mamba_inner_fn.py \
                    tests/test_norm.py tests/test_norm_kernel.py
                  run_pytest -q "${COMPAT_UPSTREAM[@]}"; show="passed|failed" ;;
    compat-upstream) ccd_ready   # 8 workers when pytest-xdist is carried: upstream's conv tests are 12,000 at GPU sizes
                     [ -d /tmp/site/xdist ] && workers=(-n 8) || workers=()
                     run_pytest -q "${workers[@]}" "${COMPAT_UPSTREAM[@]}"; show="passed|failed" ;;
    tests) run_pytest -q tests/test_selective_scan.py tests/test_mamba1.py
           ext_ready; run_pytest -q -m gpu tests/test_selective_scan.py ;;
    det-tests) run_pytest -q -s tests/test_determinism.py tests/test_determinism_kernels.py
               within python3 benchmarks/fingerprints.py --out "$OUT/fingerprints.json" --repeats 5 >>"$log" 2>&1 ;;
    gen-tests) run_pytest -q tests/test_generate.py ;;   # the checkpoint tests need the project's transformers: not here
    upstream) run_pytest -q tests/upstream ;;
    notebooks) ext_ready; within python3 -m mambalab workbook --output-dir "$OUT/wb" >>"$log" 2>&1; show=. ;;
    nb-*) [ "${step#nb-}" = 01 ] && ext_ready   # chapter 01 compares with mamba-ssm's CUDA kernel
          [ "${step#nb-}" = 05 ] && ccd_ready   # chapter 05 steps mamba-ssm's fused models (ccd-ext earlier)
          within python3 -m mambalab workbook --only "${step#nb-}" --output-dir "$OUT/wb" >>"$log" 2>&1 ;;
    bench|bench-nosweep) sweep=; [ "$step" = bench ] && sweep=--sweep
                         ext_ready; within python3 benchmarks/bench_selective_scan.py $sweep --profile \
                           --out "$OUT/selective_scan.json" >>"$log" 2>&1 ;;
    ssd-bench) # mamba-ssm's deterministic mode first: one pinned configuration each, so it compiles fast; its
               # default mode autotunes (many configurations to compile) and gets what time is left
               within python3 benchmarks/bench_ssd.py --reps 5 --mamba-deterministic --dtypes ${DTYPES:-bf16 fp32} \
                 --out "$OUT/ssd_mamba_deterministic.json" >>"$log" 2>&1
               within python3 benchmarks/bench_ssd.py --reps 5 --stages --precompile-rival 12 --dtypes ${DTYPES:-bf16 fp32} \
                 --out "$OUT/ssd_default.json" >>"$log" 2>&1 ;;
    ssd-sweep) within python3 benchmarks/bench_ssd.py --reps 3 --sweep --mamba-deterministic --dtypes ${DTYPES:-bf16 fp32} \
                 --out "$OUT/ssd_sweep.json" >>"$log" 2>&1 ;;
    ssd-fwd-sweep) within python3 benchmarks/bench_ssd.py --reps 3 --sweep forward backward --stages --mamba-deterministic \
                     --dtypes ${DTYPES:-fp32} --out "$OUT/ssd_fwd_sweep.json" >>"$log" 2>&1 ;;
    ssd-varlen-bench) within python3 benchmarks/bench_ssd.py --varlen 8 --mamba-deterministic --dtypes ${DTYPES:-bf16 fp32} \
                        --out "$OUT/ssd_varlen.json" >>"$log" 2>&1 ;;
    ssd-varlen-profile) within python3 benchmarks/bench_ssd.py --varlen 8 --mamba-deterministic --dtypes ${DTYPES:-bf16} \
                          --profile --out "$OUT/ssd_varlen_profile.json" >>"$log" 2>&1 ;;
    tilelang-a|tilelang-b) within python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir \
                             --target /tmp/tlsite .carry/$step/*.whl >>"$log" 2>&1
                           export PYTHONPATH=/tmp/tlsite:$PYTHONPATH
                           # mamba3-bench and mamba3-blocks time mamba-ssm's MIMO once its kernels import
                           [ "$step" = tilelang-b ] && within python3 benchmarks/bench_mamba3.py check-mimo-rival \
                             >>"$log" 2>&1 && touch /tmp/tlsite/.mimo-rival ;;
    mamba3-bench|mamba3-blocks)
      mimo=; [ -f /tmp/tlsite/.mimo-rival ] && mimo=--mimo-rival
      blocks=; [ "$step" = mamba3-blocks ] && blocks="--blocks-only --blocks 1024 2048"
      dir=$OUT; [ "$step" = mamba3-blocks ] && dir=$OUT/mamba3_blocks   # each writes DIR/bench_mamba3.json
      within python3 benchmarks/bench_mamba3.py --out "$dir" --precompile-rival 12 --profile $mimo $blocks \
        >>"$log" 2>&1 ;;
    decode-b64) within python3 benchmarks/bench_mamba3.py decode --batch 64 --out "$OUT/decode_b64.json" >>"$log" 2>&1 ;;
    decode-kernel) within python3 benchmarks/bench_mamba3.py step-kernel-rates --out "$OUT/decode_kernel.json" >>"$log" 2>&1 ;;
    decode-sweep) within python3 benchmarks/bench_mamba3.py step-sweep --out "$OUT/decode_sweep.json" >>"$log" 2>&1 ;;
    decode-regs) within python3 benchmarks/bench_mamba3.py step-register-sweep --out "$OUT/decode_regs.json" \
                   >>"$log" 2>&1; show="step registers|Error" ;;
    decode-ncu) within ncu --clock-control none -k regex:mamba3_step_kernel -c 4 --section SpeedOfLight \
                  --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
                  --section LaunchStats --section ComputeWorkloadAnalysis python3 benchmarks/bench_mamba3.py step-launches \
                  >>"$log" 2>&1
                show="DRAM Throughput|Duration|Memory Throughput|Achieved Occupancy|Issue Slots Busy|Registers Per|No Eligible|mamba3_step_kernel|ERR|rror" ;;
    profile-decode) ext_ready; within python3 benchmarks/profile_decode.py --configs mamba-130m mamba2-130m --batch 1 \
                      --out "$OUT/profile_decode.json" >>"$log" 2>&1 ;;
    profile-decode-*) config=${step#profile-decode-}; case $config in mamba-*) ext_ready ;; esac
                      within python3 benchmarks/profile_decode.py --configs "$config" --batch 1 \
                        --out "$OUT/profile_decode_$config.json" >>"$log" 2>&1 ;;
    generation) # the Mamba-2 configurations first (mamba-ssm's Triton kernels), then Mamba-1 (its CUDA extension)
                within python3 benchmarks/bench_generation.py --configs mamba2-130m mamba2-2.7b \
                  --out "$OUT/generation_mamba2.json" >>"$log" 2>&1
                ext_ready; within python3 benchmarks/bench_generation.py --configs mamba-130m \
                  --out "$OUT/generation_mamba1.json" >>"$log" 2>&1; show="tok/s|Error|error" ;;
    generation-*) config=${step#generation-}; case $config in mamba-*) ext_ready ;; esac
                  within python3 benchmarks/bench_generation.py --configs "$config" --out "$OUT/generation_$config.json" \
                    >>"$log" 2>&1; show="tok/s|Error|error" ;;
    train-step) within python3 benchmarks/bench_train_step.py --out "$OUT/train_step_2.7b.json" >>"$log" 2>&1
                show="^\{|Error|error" ;;
    tp-bench) for tp in 1 2; do
                within python3 -m torch.distributed.run --standalone --nproc_per_node $tp benchmarks/bench_tp.py --tp $tp \
                  --steps 12 --warmup-steps 4 --out "$OUT/tp" >>"$log" 2>&1
              done ;;
    ccd-ext) # mamba-ssm's fused Mamba2 and Mamba paths need the causal_conv1d package; built in the background
             (python3 benchmarks/mamba_cuda_ext.py --causal-conv1d .carry/causal_conv1d-*.tar.gz /tmp/ccd_ext \
                >"$OUT/ccd_build.log" 2>&1; echo "ccd build rc=$?" >>"$OUT/ccd_build.log") &
             ccd_pid=$!; echo "building causal_conv1d in the background: $OUT/ccd_build.log" >>"$log" ;;
    compat) ccd_ready; tail -1 "$OUT/ccd_build.log" >>"$log"; mkdir -p "$OUT/compat"
            within python3 benchmarks/bench_compat.py fingerprints --out "$OUT/compat" >>"$log" 2>&1
            MAMBA_DETERMINISTIC=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 within python3 benchmarks/bench_compat.py fingerprints \
              --out "$OUT/compat" >>"$log" 2>&1
            run_pytest -q -m gpu tests/test_compat_gpu.py
            pack_compat   # mambalab fingerprint --compare the routed steps' files across GPUs
            show="^\{|passed|failed|rror|ccd build" ;;
    compat-routed) ccd_built; tail -1 "$OUT/ccd_build.log" >>"$log"; mkdir -p "$OUT/compat"
                   within python3 benchmarks/bench_compat.py fingerprints --routed-only --out "$OUT/compat" >>"$log" 2>&1
                   pack_compat
                   show="^\{|rror|ccd build" ;;
    compat-speed) ccd_ready   # one process per mamba-ssm mode
                  within python3 benchmarks/bench_compat.py speed --out "$OUT/compat_speed_default.json" >>"$log" 2>&1
                  MAMBA_DETERMINISTIC=1 within python3 benchmarks/bench_compat.py speed \
                    --out "$OUT/compat_speed_deterministic.json" >>"$log" 2>&1; show="^\{|rror" ;;
    compat-profile) ccd_ready; MAMBA_DETERMINISTIC=1 within python3 benchmarks/bench_compat.py profile \
                      --out "$OUT/compat_profile.json" >>"$log" 2>&1; show="^ |---|rror" ;;
    conv-bench) ccd_ready; cands=(); for c in ${CONV_CANDIDATES:-}; do cands+=(--candidate "$c"); done
                within python3 benchmarks/bench_conv.py "${cands[@]}" --out "$OUT/conv_bench.json" >>"$log" 2>&1
                show="^\{|rror|^build" ;;
    compat-profile-routed) ext_ready; within python3 benchmarks/bench_compat.py profile --routed-only \
                             --out "$OUT/compat_profile_routed.json" >>"$log" 2>&1; show="^ |---|rror" ;;
    *) echo "unknown step $step" >>"$log" ;;
  esac
  if [ -n "$show" ]; then grep -E "$show" "$log" | cut -c1-300 | tail -n 40; else tail -n 6 "$log"; fi
  if [ -n "${PACK:-}" ]; then   # what this step left, packed now: a call cut at its limit still brings it back
    mkdir -p "$PACK"; tar czf "$PACK/results.tgz" -C "$OUT" --exclude='*.pt' --exclude='compat.tar.gz.part-*' .
    cp "$OUT"/compat.tar.gz.part-* "$PACK"/ 2>/dev/null
  fi
done
wait
tail -3 "$OUT/ext_build.log"
