"""The causal depthwise convolution's kernels (mambalab.kernels.conv1d) at the routed training step's shape, on a GPU.

    python benchmarks/bench_conv.py [--batch 4 --dim 4352 --length 4096 --width 4] [--candidate FILE[:NAME=V,...]]...
        --out FILE

Times, each the median of common.time_ms, on bf16 channel-last x (mamba-ssm's ``xBC.transpose(1, 2)``), bias, SiLU:

* mambalab's forward kernel, its backward kernel (dx and the dw / dbias partials) and the fold of the partials
  (sum_partials), with each kernel's bytes over its time (x and out; x, dout and dx);
* the whole op forward and backward through autograd, mambalab's ``causal_conv1d_fn`` against the causal_conv1d
  package's (the rival) when it imports;
* each ``--candidate``: a copy of ``mambalab/kernels/conv1d.py`` (a kernel under development) loaded from FILE,
  its module constants set from ``NAME=V`` (``BLOCK_D=32,NUM_WARPS=8``), its forward and backward kernels timed
  the same way and their out, dx and partials compared bit for bit with the package's.

The default shape is bench_compat.py speed's: d_model 2048 gives d_inner 4096 and a conv over
d_inner + 2 · ngroups · d_state = 4352 channels, b 4, l 4096.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bits, environment, time_ms, write  # noqa: E402


def load_candidate(spec: str, index: int):
    """The module in FILE of ``FILE[:NAME=V,...]`` with its constants set; its label is the spec."""
    path, _, settings = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(f"conv_candidate_{index}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    for setting in filter(None, settings.split(",")):
        name, _, value = setting.partition("=")
        if not hasattr(module, name):
            raise SystemExit(f"--candidate {spec}: {path} has no constant {name}")
        setattr(module, name, int(value))
    return module


def inputs(b: int, d: int, l: int, width: int):
    torch.manual_seed(0)
    x = torch.randn(b, l, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    dout = torch.randn(b, l, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    weight = torch.randn(d, width, device="cuda") / width
    bias = torch.randn(d, device="cuda")
    return x, dout, weight, bias


def kernels_row(module, x, dout, weight, bias, reference=None) -> dict:
    """The module's forward and backward kernels timed, with their bytes over time, and their results (out, dx,
    partials); with ``reference`` (the package's results' fingerprints, common.bits), whether each has the same
    bits (dtype, shape and every bit of every element)."""
    forward = lambda: module.causal_conv1d_fwd(x, weight, bias, None, None, False, True)
    backward = lambda: module.causal_conv1d_bwd_partials(x, weight, bias, None, None, dout, None, True)
    (out, _), (dx, _, partials) = forward(), backward()
    gigabytes = x.numel() * x.element_size() / 1e9   # one tensor of x's size
    row = {"fwd_ms": time_ms(forward), "bwd_ms": time_ms(backward)}
    row.update(fwd_TBps=2 * gigabytes / row["fwd_ms"],    # x read, out written
               bwd_TBps=3 * gigabytes / row["bwd_ms"])    # x and dout read, dx written
    if reference is not None:
        for name, mine, theirs in zip(("out", "dx", "partials"), (out, dx, partials), reference):
            row[f"{name}_same_bits"] = bits(mine) == theirs
    return row, (out, dx, partials)


def autograd_ms(fn, x, dout, weight, bias) -> float:
    x, weight, bias = (t.detach().requires_grad_() for t in (x, weight, bias))

    def step():
        fn(x, weight, bias, activation="silu").backward(dout)
    return time_ms(step)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dim", type=int, default=4352)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--width", type=int, default=4, choices=(2, 3, 4))
    parser.add_argument("--candidate", action="append", default=[], metavar="FILE[:NAME=V,...]")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_conv.py needs a CUDA GPU")

    from mambalab.kernels import conv1d
    from mambalab.kernels.reduce import sum_partials
    from mambalab.ops import causal_conv1d_fn

    x, dout, weight, bias = inputs(args.batch, args.dim, args.length, args.width)
    package, results = kernels_row(conv1d, x, dout, weight, bias)
    reference = [bits(t) for t in results]   # hashed once for every candidate
    package.update(sum_partials_ms=time_ms(lambda: sum_partials(results[2], dim=0)),
                   autograd_ms=autograd_ms(causal_conv1d_fn, x, dout, weight, bias))
    payload = {"environment": environment(), "shape": vars(args) | {"dtype": "bf16", "layout": "channel-last"},
               "mambalab": package, "candidates": {}}
    try:
        from causal_conv1d import causal_conv1d_fn as rival
    except ImportError as error:
        payload["rival"] = f"not run: {error}"
    else:
        payload["rival"] = {"autograd_ms": autograd_ms(rival, x, dout, weight, bias)}
        payload["rival"]["mambalab_over_rival"] = package["autograd_ms"] / payload["rival"]["autograd_ms"]
    for index, spec in enumerate(args.candidate):
        try:
            row, _ = kernels_row(load_candidate(spec, index), x, dout, weight, bias, reference)
        except Exception as error:   # a candidate that does not compile is a result too
            row = {"error": f"{type(error).__name__}: {str(error)[-2000:]}"}
        payload["candidates"][spec] = row
        print(spec, row, flush=True)
    write(args.out, payload)


if __name__ == "__main__":
    main()
