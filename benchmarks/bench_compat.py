"""mamba-ssm's and transformers' models on mambalab's kernels (mambalab.compat.use_mambalab_kernels), on a GPU.

    python benchmarks/bench_compat.py fingerprints --out DIR    the fixed training step of every model of
        mambalab.determinism.library_step (size "gpu"): routed, twice and under two emulated GPU profiles, each
        routed step saved as DIR/<gpu>_<model>.pt (for mambalab fingerprint --compare across GPUs); then the
        library's own kernels: 5 runs, and one under each emulated profile, counting distinct gradient bit
        patterns and the parameters whose gradients vary, and the routed gradients' largest relative difference
        from the library's own; in mamba-ssm's deterministic mode also with torch's deterministic algorithms on. The mode of
        mamba-ssm's own kernels is the process's (MAMBA_DETERMINISTIC=1 before import: its deterministic mode).
        mamba-ssm's autotuners try one configuration each (its smallest, oracle.single_config): autotuning them
        all would take minutes a shape; the order of their sums within a configuration is what is measured.
        Also mambalab's own fixed step (mambalab fingerprint --save) as DIR/<gpu>_mambalab.pt. With
        --routed-only the routed steps and their files alone (DIR/compat_fingerprints_routed.json): what comparing
        GPUs needs, in a fraction of the time, and no mamba-ssm kernel is run.
    python benchmarks/bench_compat.py speed --out FILE    one training step (forward and backward, bf16 autocast,
        fp32 parameters) of mamba-ssm's MambaLMHeadModel with Mamba-2 layers, d_model 2048, 8 layers, b 4, l 4096,
        vocabulary 1024: routed and mamba-ssm's own in the same process (its mode, as above), medians of
        common.time_ms.
    python benchmarks/bench_compat.py profile [--routed-only] --out FILE    that step under torch.profiler, routed
        and mamba-ssm's own (or the routed one alone: no causal_conv1d package needed): the operators and kernels
        that take the time, and the call sites of the routed step's fills, copies and cats (common.call_sites).

gpu_run.sh's `compat` step runs the fingerprints and `compat-speed` the speed, once per mamba-ssm mode, one process
each.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import call_sites, environment, profile_table, time_ms, write  # noqa: E402

PROFILES = ("rtx4090", "rtxa6000")
GLUE = ("aten::fill_", "aten::copy_", "aten::cat")   # PyTorch's own work between the kernels, traced to its callers


def _mode() -> str:
    return "deterministic" if os.environ.get("MAMBA_DETERMINISTIC", "")[:1] == "1" else "default"


def _gpu_tag() -> str:
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-").lower()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _grads(tensors: dict) -> dict:
    """The gradients alone (a language model's logits are 16 MiB: the report keeps their fingerprint)."""
    return {k: v for k, v in tensors.items() if k.startswith("grad/")}


def _patterns(prefix: str, runs: list[dict], emulated: list[dict]) -> dict:
    """Distinct gradient bit patterns over repeated runs and over the emulated profiles (with the first run), and
    which parameters' gradients vary in each (parameter: number of patterns)."""
    def varying(reports):
        names = reports[0]["parameters"]
        counts = {n: len({rep["parameters"][n] for rep in reports}) for n in names}
        return {n: c for n, c in counts.items() if c > 1}

    return {f"{prefix}_fingerprint": runs[0]["fingerprint"],
            f"{prefix}_patterns_over_{len(runs)}_runs": len({rep["fingerprint"] for rep in runs}),
            f"{prefix}_varying_over_runs": varying(runs),
            f"{prefix}_patterns_over_profiles": len({rep["fingerprint"] for rep in [runs[0], *emulated]}),
            f"{prefix}_varying_over_profiles": varying([runs[0], *emulated])}


def _transformers_fused_function() -> str:
    """Which function transformers' ``mamba2_split_conv1d_scan_combined`` wrapper resolved when transformers was
    imported (``integrations/hub_kernels.py`` of transformers 5.25 keeps it in the wrapper's closure): the module
    of mamba-ssm's function, or "PyTorch" for transformers' own path; "unknown" where the wrapper is not laid out so."""
    from transformers.models.mamba2 import modeling_mamba2

    def closure(fn) -> dict:
        code = getattr(fn, "__code__", None)
        return {} if code is None else {k: c.cell_contents for k, c in zip(code.co_freevars, fn.__closure__ or ())}

    wrapped = closure(getattr(modeling_mamba2.mamba2_split_conv1d_scan_combined, "forward", None)).get("func")
    cells = closure(wrapped)
    if "implementation" not in cells:
        return "unknown"
    return "PyTorch" if not cells.get("is_new_implementation") else getattr(cells["implementation"], "__module__", "?")


def _file_name(model: str) -> str:
    """A model's name as a file name: "transformers.Mamba2ForCausalLM(use_cache=False)" gives
    "transformers_Mamba2ForCausalLM_use_cache_False"."""
    return re.sub(r"[^A-Za-z0-9]+", "_", model).strip("_")


def fingerprints(out: Path, routed_only: bool = False) -> dict:
    """The rows of the module docstring's ``fingerprints``; with ``routed_only`` the routed steps alone (their
    fingerprints and .pt files: what a comparison across GPUs needs), none of mamba-ssm's own kernels."""
    from mambalab.determinism import library_step, step

    out.mkdir(parents=True, exist_ok=True)
    tag, rows = _gpu_tag(), []
    report, tensors = step.run_step(return_tensors=True)
    step.save_step(out / f"{tag}_mambalab.pt", report, _grads(tensors))
    rows.append(dict(model="mambalab.Mamba2 (mambalab fingerprint)", routed=True, fingerprint=report["fingerprint"]))
    for model in library_step.MODELS:
        row = dict(model=model, mamba_ssm_mode=_mode())
        if model.startswith("transformers."):   # its own path on this machine: mamba-ssm's fused function or PyTorch
            row["transformers_fused_function"] = _transformers_fused_function()
        try:
            first, mine = library_step.run(model, size="gpu", return_tensors=True)
            step.save_step(out / f"{tag}_{_file_name(model)}.pt", first, _grads(mine))
            again = library_step.run(model, size="gpu")["fingerprint"]
            emulated = [library_step.run(model, size="gpu", emulate_profile=p)["fingerprint"] for p in PROFILES]
            row.update(routed_fingerprint=first["fingerprint"],
                       routed_patterns_over_runs=len({first["fingerprint"], again}),
                       routed_patterns_over_profiles=len({first["fingerprint"], *emulated}))
            if not routed_only:
                _own(model, row, mine, out)
        except Exception as err:   # keep what was measured; say what failed
            row["error"] = f"{type(err).__name__}: {err}"[:400]
        rows.append(row)
        print(json.dumps(row), flush=True)
        result = _fingerprints_result(out, rows, routed_only)   # after each row: a run cut short keeps them
    return result


def _own(model: str, row: dict, mine: dict, out: Path) -> None:
    """Add to ``row`` mamba-ssm's own kernels' patterns for ``model`` (5 runs and the emulated profiles; in its
    deterministic mode also with torch's deterministic algorithms on) and the routed gradients' (``mine``)
    largest relative difference from its own; save its last run's step file in ``out``."""
    from mambalab import oracle
    from mambalab.determinism import library_step, step

    with oracle.single_config(smallest=True):
        runs = [library_step.run(model, routed=False, size="gpu", return_tensors=True) for _ in range(5)]
        emulated = [library_step.run(model, routed=False, size="gpu", emulate_profile=p) for p in PROFILES]
    r, t = runs[-1]
    row.update(_patterns("own", [rep for rep, _ in runs], emulated))
    if _mode() == "deterministic":   # and torch's deterministic algorithms: the most a user can switch on
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with oracle.single_config(smallest=True):
                det = [library_step.run(model, routed=False, size="gpu") for _ in range(3)]
                det_emulated = [library_step.run(model, routed=False, size="gpu", emulate_profile=p)
                                for p in PROFILES]
        finally:
            torch.use_deterministic_algorithms(False)
        row.update(_patterns("own_with_torch_deterministic", det, det_emulated))
    step.save_step(out / f"{_gpu_tag()}_{_file_name(model)}_own_{_mode()}.pt", r, _grads(t))
    row["max_rel_diff_routed_vs_own"] = max(_rel(mine[k], t[k]) for k in mine)


def _fingerprints_result(out: Path, rows: list, routed_only: bool) -> dict:
    """The rows so far as the JSON file of ``fingerprints``, written."""
    flag = " --routed-only" if routed_only else ""
    result = dict(environment=environment(), rows=rows,
                  command=f"MAMBA_DETERMINISTIC={os.environ.get('MAMBA_DETERMINISTIC', '')} "
                          f"python benchmarks/bench_compat.py fingerprints{flag} --out {out}")
    name = "compat_fingerprints_routed.json" if routed_only else f"compat_fingerprints_{_mode()}.json"
    write(out / name, result, quiet=True)
    return result


def _speed_model():
    """The speed benchmark's model and its training step (a closure)."""
    from mambalab import oracle

    oracle.load()
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    torch.manual_seed(0)
    config = MambaConfig(d_model=2048, n_layer=8, vocab_size=1024, ssm_cfg=dict(layer="Mamba2"))
    model = MambaLMHeadModel(config, device="cuda")
    ids = torch.randint(0, 1024, (4, 4097), device="cuda")

    def train_step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()

    return train_step


def speed() -> dict:
    from mambalab.compat import use_mambalab_kernels

    train_step = _speed_model()
    own = time_ms(train_step, warmup=500, rep=2000)
    with use_mambalab_kernels():
        routed = time_ms(train_step, warmup=500, rep=2000)
    row = dict(shape="MambaLMHeadModel Mamba2, d_model 2048, 8 layers, b4 l4096, vocab 1024, bf16 autocast",
               mamba_ssm_mode=_mode(), routed_ms=routed, mamba_ssm_ms=own, ratio=routed / own)
    print(json.dumps(row), flush=True)
    return dict(environment=environment(), command=f"bench_compat.py speed (mamba-ssm {_mode()} mode)", rows=[row])


def profile(routed_only: bool = False) -> dict:
    """The speed benchmark's step under torch.profiler (common.profile_table), routed and mamba-ssm's own; with
    ``routed_only`` the routed step alone, 40 rows (mamba-ssm's own Mamba2 path needs the causal_conv1d package,
    the routed one does not)."""
    from mambalab.compat import use_mambalab_kernels

    train_step = _speed_model()
    own = None if routed_only else profile_table(train_step, steps=2, rows=25)
    with use_mambalab_kernels():
        routed = profile_table(train_step, steps=2, rows=40 if routed_only else 25)
        glue = call_sites(train_step, GLUE)
    for side, table in (("routed", routed), ("mamba_ssm", own or [])):
        print(f"--- {side} ({_mode()} mode): ms a step, calls a step, operator or kernel")
        for r in table:
            print(f"{r['self_ms_per_step']:9.2f} {r['calls_per_step']:7.0f}  {r['name'][:110]}")
    print("--- routed: where PyTorch's fills, copies and cats are called from (ms a step, calls a step)")
    for r in glue[:20]:
        print(f"{r['ms_per_step']:9.2f} {r['calls_per_step']:7.0f}  {r['name']}  " + " < ".join(r["site"][:4])[:300])
    return dict(environment=environment(), command=f"bench_compat.py profile{' --routed-only' if routed_only else ''} "
                                                   f"(mamba-ssm {_mode()} mode)", routed=routed, mamba_ssm=own,
                routed_glue=glue)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("fingerprints", "speed", "profile"))
    parser.add_argument("--out", required=True, help="fingerprints: a folder; speed, profile: a JSON file")
    parser.add_argument("--routed-only", action="store_true",
                        help="fingerprints, profile: the routed steps alone, none of mamba-ssm's own kernels")
    args = parser.parse_args()
    if args.routed_only and args.what == "speed":
        parser.error("--routed-only goes with fingerprints or profile")
    if args.what == "fingerprints":
        fingerprints(Path(args.out), args.routed_only)
    else:
        write(args.out, speed() if args.what == "speed" else profile(args.routed_only))


if __name__ == "__main__":
    main()
