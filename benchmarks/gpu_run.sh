#!/usr/bin/env bash
# What we run on a lent GPU machine (no network there): install the carried wheels, compile mamba-ssm's
# CUDA extension (our rival) in the background, run the GPU tests, then the workbook and the benchmark.
#   carried: .whl/ (mamba-ssm's wheel built with MAMBA_SKIP_CUDA_BUILD=TRUE; papermill, plotly, ipywidgets,
#            ipykernel, nbconvert and their missing dependencies) and .carry/ (mamba-ssm's sdist)
#   usage:   bash benchmarks/gpu_run.sh STEP...   with STEP in: tests, notebooks, bench (with the tile sweep), bench-nosweep,
#            ssd-tests, ssd-bench (mambalab's SSD vs mamba_chunk_scan_combined, default and deterministic; SSD_DTYPES),
#            ssd-sweep (tile configurations), ssd-fwd-sweep (each side's kernels alone, SWEEP_PARTS, SWEEP_DTYPES: fp32 by default), mamba3-tests, mamba3-bench, det-tests, gpu-tests (every GPU-only test),
#            tp-bench (TP=1 on one GPU, TP=2 on two), nb-NN (one notebook at its GPU size), gen-tests (generation
#            and checkpoints, CUDA-graph decoding included), generation (bench_generation.py against mamba-ssm's
#            generate), decode-b64 (the Mamba-3 decode step at batch 64: time and achieved bandwidth), upstream
#            (mamba-ssm's own tests against mambalab, upstream sizes), ssd-varlen-bench (8 packed sequences against
#            mamba_chunk_scan_combined with seq_idx), ssd-varlen-profile (the same, VARLEN_DTYPES, bf16 by default, with each side's kernels),
#            decode-sweep (the Mamba-3 decode step's tile choices at batch 64), decode-kernel (its kernel's own rate,
#            profiler and a graph of 8 layers' steps), decode-ncu (Nsight Compute on it, r = 1 and 4), decode-regs (its register cap), profile-decode (one decode step's
#            kernels as CUDA graphs, mambalab against mamba-ssm, batch 1),
#            tilelang-a, tilelang-b (install the TileLang wheels of benchmarks/tilelang_wheels.sh into /tmp/tlsite, for
#            mamba-ssm's MIMO kernels: the wheels exceed one call's carry limit, so carry .carry/tilelang-a alone
#            for tilelang-a, then .carry/tilelang-b with .whl for tilelang-b in the next call, while the machine
#            is still warm), ccd-ext (build the causal_conv1d package in the background), compat-tests (the GPU tests
#            of layer_norm_fn, causal_conv1d_fn, mamba_inner_fn), compat (mamba-ssm's and transformers' models
#            routed onto mambalab: fingerprints in both mamba-ssm modes, their GPU tests, the speed; needs ccd-ext
#            earlier in the same call and .carry/transformers)
#   Steps after `tests` wait for the extension and can import it (its build folder joins PYTHONPATH).
set -uo pipefail
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
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
if [ "${SKIP_EXT:-0}" = 1 ]; then   # steps that need no Mamba-1 CUDA extension: don't spend minutes building it
  echo "extension build skipped (SKIP_EXT=1)" >"$OUT/ext_build.log"; build_pid=
else
  (python3 benchmarks/mamba_cuda_ext.py "$SDIST" "$EXT_DIR" >"$OUT/ext_build.log" 2>&1; echo "ext build rc=$?" >>"$OUT/ext_build.log") &
  build_pid=$!
fi
ext_ready() { [ -n "$build_pid" ] && wait "$build_pid" 2>/dev/null; case ":$PYTHONPATH:" in *":$EXT_DIR:"*) ;; *) export PYTHONPATH=$PYTHONPATH:$EXT_DIR ;; esac; }
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    # Each step logs to $OUT/<step>.log as it goes, so a run cut short still says how far it got (a step
    # piped through `tail` keeps nothing when it is killed).
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_selective_scan.py tests/test_mamba1.py \
             >"$OUT/tests.log" 2>&1
           ext_ready
           python3 -m pytest -q -p no:cacheprovider tests/test_selective_scan.py -k cuda_kernel >>"$OUT/tests.log" 2>&1
           tail -4 "$OUT/tests.log" ;;
    notebooks) ext_ready; timeout 400 python3 -m mambalab workbook --output-dir "$OUT/wb" >"$OUT/notebooks.log" 2>&1
               tail -15 "$OUT/notebooks.log" ;;
    bench) ext_ready; python3 benchmarks/bench_selective_scan.py --sweep --profile --out "$OUT/selective_scan.json" \
             >"$OUT/bench.log" 2>&1; tail -12 "$OUT/bench.log" ;;
    bench-nosweep) ext_ready; python3 benchmarks/bench_selective_scan.py --profile --out "$OUT/selective_scan.json" \
                     >"$OUT/bench-nosweep.log" 2>&1; tail -6 "$OUT/bench-nosweep.log" ;;
    ssd-tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -k "gpu or test_mamba2" tests/test_ssd_kernels.py tests/test_ssd_backward.py \
                 tests/test_ssd_ref.py tests/test_mamba2.py >"$OUT/ssd-tests.log" 2>&1; tail -5 "$OUT/ssd-tests.log" ;;
    ssd-bench) # mamba-ssm's deterministic mode first: one pinned configuration each, so it compiles fast; its
               # default mode autotunes (many configurations to compile) and gets what time is left
               timeout "${SSD_DET_T:-110}" python3 benchmarks/bench_ssd.py --reps 5 --mamba-deterministic --dtypes ${SSD_DTYPES:-bf16 fp32} --out "$OUT/ssd_mamba_deterministic.json" \
                 >"$OUT/ssd-bench.log" 2>&1
               timeout "${SSD_DEF_T:-150}" python3 benchmarks/bench_ssd.py --reps 5 --stages --precompile-rival "${SSD_JOBS:-12}" --dtypes ${SSD_DTYPES:-bf16 fp32} --out "$OUT/ssd_default.json" >>"$OUT/ssd-bench.log" 2>&1
               tail -3 "$OUT/ssd-bench.log" ;;
    ssd-sweep) # tile configurations of mambalab's SSD beside mamba-ssm's deterministic mode (pinned: compiles fast)
               timeout "${SSD_SWEEP_T:-300}" python3 benchmarks/bench_ssd.py --reps 3 --sweep --mamba-deterministic \
                 --out "$OUT/ssd_sweep.json" >"$OUT/ssd-sweep.log" 2>&1; tail -3 "$OUT/ssd-sweep.log" ;;
    mamba3-tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -k "gpu or test_mamba3_module" tests/test_mamba3_kernels.py tests/test_mamba3_ref.py \
                    tests/test_mamba3_module.py >"$OUT/mamba3-tests.log" 2>&1; tail -5 "$OUT/mamba3-tests.log" ;;
    tilelang-a|tilelang-b) python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir \
                             --target /tmp/tlsite .carry/$step/*.whl
                           export PYTHONPATH=/tmp/tlsite:$PYTHONPATH
                           [ "$step" = tilelang-b ] && python3 -c "import tilelang; print('tilelang', tilelang.__version__)" ;;
    mamba3-bench) timeout "${M3_T:-120}" python3 benchmarks/bench_mamba3.py --out "$OUT" --precompile-rival "${M3_JOBS:-12}" --profile ${M3_ARGS:-} \
                    >"$OUT/mamba3-bench.log" 2>&1
                  tail -5 "$OUT/mamba3-bench.log" ;;
    det-tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -s tests/test_determinism.py tests/test_determinism_kernels.py \
                 >"$OUT/det-tests.log" 2>&1; tail -5 "$OUT/det-tests.log"
               timeout 200 python3 benchmarks/fingerprints.py --out "$OUT/fingerprints.json" --repeats 5 >>"$OUT/det-tests.log" 2>&1 ;;
    gpu-tests) # every test marked gpu (tests/test_gpu_marker.py keeps the marker on every test that skips without CUDA)
               timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -v -p no:cacheprovider -rs -m gpu tests \
                 >"$OUT/gpu-tests.log" 2>&1; tail -8 "$OUT/gpu-tests.log" ;;
    upstream) timeout "${UPSTREAM_T:-400}" python3 -m pytest -q -p no:cacheprovider -rs tests/upstream \
                >"$OUT/upstream.log" 2>&1; tail -6 "$OUT/upstream.log" ;;
    ssd-varlen-bench) timeout "${VARLEN_T:-200}" python3 benchmarks/bench_ssd.py --varlen 8 --mamba-deterministic --dtypes ${VARLEN_DTYPES:-bf16 fp32} \
                        --out "$OUT/ssd_varlen.json" >"$OUT/ssd-varlen-bench.log" 2>&1; tail -6 "$OUT/ssd-varlen-bench.log" ;;
    tp-bench) timeout "${TP_T:-90}" python3 -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/bench_tp.py --tp 1 --steps 12 --warmup-steps 4 \
                --out "$OUT/tp" >"$OUT/tp-bench.log" 2>&1
              timeout "${TP_T:-90}" python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_tp.py --tp 2 --steps 12 --warmup-steps 4 \
                --out "$OUT/tp" >>"$OUT/tp-bench.log" 2>&1; tail -4 "$OUT/tp-bench.log" ;;
    decode-tests) # the decode-step kernels alone (a subset of gpu-tests): state update, conv update, gated norm
                  timeout "${DECODE_TESTS_T:-120}" python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
                    tests/test_state_update.py tests/test_conv_update.py tests/test_norm_kernel.py \
                    >"$OUT/decode-tests.log" 2>&1; tail -4 "$OUT/decode-tests.log" ;;
    gen-tests) # the checkpoint tests are CPU tests against the transformers the project installs (the GPU image's
               # is another version), so not here
               timeout "${GEN_TESTS_T:-150}" python3 -m pytest -q -p no:cacheprovider -rs tests/test_generate.py \
                 >"$OUT/gen-tests.log" 2>&1; tail -4 "$OUT/gen-tests.log" ;;
    generation) # Mamba-2 configurations first (mamba-ssm's Triton kernels), then Mamba-1 (its CUDA extension);
                # GEN2_CONFIGS=none runs the Mamba-1 configuration alone
                gen2=${GEN2_CONFIGS:-mamba2-130m mamba2-2.7b}
                [ "$gen2" != none ] && timeout "${GEN2_T:-240}" python3 benchmarks/bench_generation.py --configs $gen2 \
                  --out "$OUT/generation_mamba2.json" >"$OUT/generation.log" 2>&1
                ext_ready
                [ "${GEN1:-1}" = 1 ] && timeout "${GEN1_T:-120}" python3 benchmarks/bench_generation.py --configs mamba-130m \
                  --out "$OUT/generation_mamba1.json" >>"$OUT/generation.log" 2>&1
                grep -E "tok/s|Error|error" "$OUT/generation.log" | tail -40 ;;
    decode-b64) timeout "${DEC_T:-90}" python3 -c "
import json, sys; sys.path.insert(0, 'benchmarks')
from bench_mamba3 import decode
rows = [decode(64, 32, 64, 1, 128, 32, r) for r in (1, 2, 4)]
for s in rows: s['graph_over_r1'] = s['graph_ms'] / rows[0]['graph_ms'] if all(isinstance(t['graph_ms'], float) for t in (s, rows[0])) else None
from common import environment; json.dump(dict(environment=environment(), command='gpu_run.sh decode-b64', rows=rows), open('$OUT/decode_b64.json', 'w'), indent=2)
for s in rows: print('decode b64 r=%d eager %.1f us graph %s us graph GB/s %s' % (s['r'], s['ms'] * 1e3, s['graph_ms'] * 1e3 if isinstance(s['graph_ms'], float) else s['graph_ms'], s['graph_GB_per_s']))
" >"$OUT/decode-b64.log" 2>&1; tail -4 "$OUT/decode-b64.log" ;;
    decode-sweep) timeout "${DSW_T:-200}" python3 -c "
import json, sys; sys.path.insert(0, 'benchmarks')
from bench_mamba3 import step_sweep
from common import environment
rows = step_sweep(64, 32, 64, 1, 128, 32)
json.dump(dict(environment=environment(), command='gpu_run.sh decode-sweep', rows=rows), open('$OUT/decode_sweep.json', 'w'), indent=2)
" >"$OUT/decode-sweep.log" 2>&1; tail -3 "$OUT/decode-sweep.log" ;;
    decode-kernel) # the step kernel's own duration (profiler) and per step in a graph of 8 layers' steps, at batch 64
                   timeout "${DK_T:-150}" python3 -c "
import json, sys; sys.path.insert(0, 'benchmarks')
from bench_mamba3 import step_kernel_rates
from common import environment
rows = step_kernel_rates(64, 32, 64, 1, 128, 32)
json.dump(dict(environment=environment(), command='gpu_run.sh decode-kernel', rows=rows), open('$OUT/decode_kernel.json', 'w'), indent=2)
" >"$OUT/decode-kernel.log" 2>&1; tail -5 "$OUT/decode-kernel.log" ;;
    decode-regs) # the step kernel's register cap and a few tiles, at batch 64 (bench_mamba3.step_register_sweep)
                 timeout "${DR_T:-200}" python3 -c "
import json, sys; sys.path.insert(0, 'benchmarks')
from bench_mamba3 import step_register_sweep
from common import environment
rows = []
out = lambda: json.dump(dict(environment=environment(), command='gpu_run.sh decode-regs', rows=rows), open('$OUT/decode_regs.json', 'w'), indent=2)
rows.extend(step_register_sweep(64, 32, 64, 1, 128, 32)); out()
" >"$OUT/decode-regs.log" 2>&1; grep -E "step registers|Error" "$OUT/decode-regs.log" | cut -c1-260 | tail -20 ;;
    decode-ncu) # Nsight Compute on the step kernel at batch 64, r = 1 then r = 4 (two launches each)
                timeout "${NCU_T:-180}" ncu --clock-control none -k regex:mamba3_step_kernel -c 4 --section SpeedOfLight \
                  --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
                  --section LaunchStats --section ComputeWorkloadAnalysis python3 -c "
import sys, torch; sys.path.insert(0, 'benchmarks')
from bench_mamba3 import step_inputs, random_ssm_state
from mambalab.ops import mamba3_step
with torch.no_grad():
    for r in (1, 1, 4, 4):
        tok, mimo = step_inputs(64, 32, 64, 1, 128, 32, r)
        mamba3_step(random_ssm_state(64, 32, 64, 128, r, 32), **tok, **mimo)
    torch.cuda.synchronize()
" >"$OUT/decode-ncu.log" 2>&1; grep -E "DRAM Throughput|Duration|Memory Throughput|Achieved Occupancy|Issue Slots Busy|Registers Per|No Eligible|mamba3_step_kernel|ERR|rror" "$OUT/decode-ncu.log" | head -40 ;;
    profile-decode) ext_ready; timeout "${PD_T:-200}" python3 benchmarks/profile_decode.py --configs ${PD_CONFIGS:-mamba-130m mamba2-130m} --batch 1 \
                      --out "$OUT/profile_decode.json" >"$OUT/profile-decode.log" 2>&1; tail -6 "$OUT/profile-decode.log" ;;
    ssd-fwd-sweep) # the forward's tiles alone, wider (head-dimension blocks too), with each forward step timed
                   timeout "${SSD_SWEEP_T:-200}" python3 benchmarks/bench_ssd.py --reps 3 --sweep ${SWEEP_PARTS:-forward backward} --stages --mamba-deterministic \
                     --dtypes ${SWEEP_DTYPES:-fp32} --out "$OUT/ssd_fwd_sweep.json" >"$OUT/ssd-fwd-sweep.log" 2>&1
                   tail -3 "$OUT/ssd-fwd-sweep.log" ;;
    ssd-varlen-profile) timeout "${VARLEN_T:-200}" python3 benchmarks/bench_ssd.py --varlen 8 --mamba-deterministic --dtypes ${VARLEN_DTYPES:-bf16} \
                          --profile --out "$OUT/ssd_varlen_profile.json" >"$OUT/ssd-varlen-profile.log" 2>&1
                        tail -3 "$OUT/ssd-varlen-profile.log" ;;
    nb-*) only=${step#nb-}; [ "$only" = 01 ] && ext_ready   # chapter 01 compares with mamba-ssm's CUDA kernel
          timeout "${NB_T:-500}" python3 -m mambalab workbook --only "$only" --output-dir "$OUT/wb" \
            >"$OUT/$step.log" 2>&1; tail -4 "$OUT/$step.log" ;;
    ccd-ext) # the causal_conv1d package (mamba-ssm's fused Mamba2 and Mamba paths need it), built in the background
             (python3 benchmarks/mamba_cuda_ext.py --causal-conv1d .carry/causal_conv1d-*.tar.gz /tmp/ccd_ext \
                >"$OUT/ccd_build.log" 2>&1; echo "ccd build rc=$?" >>"$OUT/ccd_build.log") &
             ccd_pid=$! ;;
    compat-tests) # the new drop-ins' GPU tests (mambalab against mamba-ssm's own kernels: Triton, CUDA, causal_conv1d)
                  ext_ready; [ -n "${ccd_pid:-}" ] && wait "$ccd_pid"; export PYTHONPATH=$PYTHONPATH:/tmp/ccd_ext
                  timeout "${COMPAT_TESTS_T:-200}" python3 -m pytest -q -p no:cacheprovider -rs \
                    tests/test_layer_norm_fn.py tests/test_causal_conv1d_fn.py tests/test_mamba_inner_fn.py \
                    >"$OUT/compat-tests.log" 2>&1
                  timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/upstream/test_selective_scan.py \
                    -k mamba_inner >>"$OUT/compat-tests.log" 2>&1; grep -E "passed|failed" "$OUT/compat-tests.log" ;;
    compat) # mamba-ssm's and transformers' models routed onto mambalab (bench_compat.py), both mamba-ssm modes;
            # transformers as the project pins it (carried in .carry/transformers: the image's is older)
            ext_ready; [ -n "${ccd_pid:-}" ] && wait "$ccd_pid"; tail -1 "$OUT/ccd_build.log"
            export PYTHONPATH=/tmp/tfsite:$PYTHONPATH:/tmp/ccd_ext; : >"$OUT/compat.log"
            mkdir -p "$OUT/compat"
            timeout "${COMPAT_FP_T:-150}" python3 benchmarks/bench_compat.py fingerprints --out "$OUT/compat" >>"$OUT/compat.log" 2>&1
            MAMBA_DETERMINISTIC=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout "${COMPAT_FP_T:-150}" python3 benchmarks/bench_compat.py fingerprints \
              --out "$OUT/compat" >>"$OUT/compat.log" 2>&1
            [ "${COMPAT_GPU_TESTS:-1}" = 1 ] && timeout "${COMPAT_T:-150}" python3 -m pytest -q -p no:cacheprovider -rs \
              tests/test_compat_gpu.py >>"$OUT/compat.log" 2>&1
            if [ "${COMPAT_SPEED:-1}" = 1 ]; then
              timeout 100 python3 benchmarks/bench_compat.py speed --out "$OUT/compat/compat_speed_default.json" >>"$OUT/compat.log" 2>&1
              MAMBA_DETERMINISTIC=1 timeout 100 python3 benchmarks/bench_compat.py speed \
                --out "$OUT/compat/compat_speed_deterministic.json" >>"$OUT/compat.log" 2>&1
            fi
            # the JSON and the routed steps' .pt files (mambalab fingerprint --compare them across GPUs), in parts
            # small enough to come back from the device machine (16 MiB a file)
            tar czf - -C "$OUT" --exclude='*_own_*' compat | split -b 15M - "$OUT/compat.tar.gz.part-"; grep -E "^\{|passed|failed|rror" "$OUT/compat.log" | cut -c1-400 | tail -30 ;;
    *) echo "unknown step $step" ;;
  esac
done
wait
tail -3 "$OUT/ext_build.log"
