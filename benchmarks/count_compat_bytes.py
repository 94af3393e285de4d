"""The bytes PyTorch operators read and write in one routed training step of mamba-ssm's MambaLMHeadModel (one
Mamba-2 layer, d_model 2048, bf16 autocast), counted on the CPU, per token and per mambalab function.

    python benchmarks/count_compat_bytes.py [--lengths 256 512] [--out FILE]

A **count, not a timing**: every aten operator the step dispatches (views and allocations left out, and the
copies Triton's interpreter makes on the CPU) adds the bytes of its tensor inputs and outputs, attributed to the
innermost ``mambalab/`` function on the Python stack ("autograd or mamba-ssm" where there is none: mamba-ssm's
own module code and the backward of plain PyTorch ops). The difference between two lengths, divided by the
difference in tokens, is the traffic a token adds. On a GPU those operators are separate kernels that each make
one pass over memory, so bytes / bandwidth is a floor on their time; the Triton kernels (the SSD, the fixed-order
sums) are not counted.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write  # noqa: E402

NOT_TRAFFIC = {"view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze", "slice",
               "select", "expand", "split", "split_with_sizes", "unflatten", "reshape", "alias", "detach", "narrow",
               "chunk", "unbind", "empty", "empty_like", "empty_strided", "new_empty", "set_", "resolve_conj",
               "resolve_neg", "lift_fresh",
               "copy_", "_to_copy"}   # the interpreter's copies in and out of its kernels, and dtype casts


def _nbytes(x) -> int:
    items = x if isinstance(x, (list, tuple)) else [x]
    return sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in NOT_TRAFFIC:
            where = next((f"{f.filename.split('/mambalab/')[-1]}:{f.name}" for f in reversed(traceback.extract_stack())
                          if "/mambalab/" in f.filename), "autograd or mamba-ssm")
            self.bytes[where] += (sum(_nbytes(a) for a in args) + sum(_nbytes(v) for v in (kwargs or {}).values())
                                  + _nbytes(out))
        return out


def count(length: int) -> collections.Counter:
    from mambalab import oracle
    from mambalab.compat import use_mambalab_kernels

    oracle.load()
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=2048, n_layer=1, vocab_size=1024, ssm_cfg=dict(layer="Mamba2")))
    ids = torch.randint(0, 1024, (1, length + 1))
    with use_mambalab_kernels(), _Count() as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    return counter.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=[256, 512])
    parser.add_argument("--out", help="a JSON file for the table")
    args = parser.parse_args()
    short, long = sorted(args.lengths)
    if short < 1 or short == long:
        parser.error(f"--lengths: two different positive lengths expected; got {args.lengths}")
    a, b = count(short), count(long)
    per_token = {k: (b[k] - a[k]) / (long - short) for k in b}
    rows = [dict(where=k, bytes_per_token=v) for k, v in sorted(per_token.items(), key=lambda kv: -kv[1]) if v > 0]
    print(f"{sum(per_token.values()) / 1e6:.2f} MB a token a layer in all")
    for r in rows:
        print(f"{r['bytes_per_token'] / 1e3:10.1f} kB  {r['where']}")
    if args.out:
        write(args.out, dict(environment=environment(), rows=rows,
                             command=f"python benchmarks/count_compat_bytes.py --lengths {short} {long}"))


if __name__ == "__main__":
    main()
