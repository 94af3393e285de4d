"""Worker programs the distributed tests launch with torchrun (gloo, CPU): ``torchrun … workers.py NAMES OUT``.

NAMES is a comma-separated list of the checks below; each rank writes {name: what it measured} to
OUT/rank{r}.json, and the tests assert on those files.

* ``grads``: every parameter's gradient of a TP = T Mamba-2 LM (gathered) against the TP = 1 model's, with and
  without sequence parallelism, on the Triton kernels and on the reference scan.
* ``torch_tp``: mambalab's parallel layers against the same model parallelised by
  ``torch.distributed.tensor.parallel`` (ColwiseParallel / RowwiseParallel, loss_parallel).
"""
import json
import sys
from pathlib import Path

import mambalab  # noqa: F401  (before triton)
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mambalab.modules.lm import LMConfig, MambaLM
from mambalab.parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelMambaLM, VocabParallelEmbedding,
                               allreduce_replicated_grads, gather_full, init_distributed, load_full_state_dict,
                               vocab_parallel_cross_entropy)

# A tiny LM with every kind of parameter: biases in the projections (a rank-0-only out_proj bias), untied head.
CONFIG = dict(vocab_size=32, d_model=16, n_layer=1, d_state=16, headdim=8, ngroups=4, chunk_size=16,
              tie_embeddings=False)


def _max_diffs(got: dict, want: dict) -> dict:
    return {k: (got[k] - want[k]).abs().max().item() for k in want}


def grads(layout, out: dict) -> None:
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, 32, (2, 32), generator=g), torch.randint(0, 32, (2, 32), generator=g)
    for scan in ("kernel", "reference"):
        cfg = LMConfig(**CONFIG, scan=scan)
        torch.manual_seed(0)
        full = MambaLM(cfg)
        for layer in full.layers:   # give the biases non-trivial values
            layer.mixer.conv1d.bias.data.normal_()
        full.loss(ids, targets).backward()
        want = {n: p.grad for n, p in full.named_parameters()}
        for sp in ((False, True) if scan == "reference" else (True,)):
            model = TensorParallelMambaLM(cfg, layout, sequence_parallel=sp)
            load_full_state_dict(model, full.state_dict(), layout.tp_rank)
            loss = model.loss(ids, targets)
            loss.backward()
            if sp:
                allreduce_replicated_grads(model.replicated_parameters(), layout)
            got = gather_full(model, layout.tp, layout.tp_group, grads=True)
            out[f"{scan}/sp={sp}"] = {"loss": loss.item(), "grad_diff": _max_diffs(got, want),
                                      "grad_scale": max(v.abs().max().item() for v in want.values())}
        out[f"{scan}/loss_ref"] = full.loss(ids, targets).item()


class TinyModel(nn.Module):
    """embedding -> linear (column) -> gelu -> linear (row) -> head (column over the vocabulary)."""

    def __init__(self, emb, up, down, head):
        super().__init__()
        self.emb, self.up, self.down, self.head = emb, up, down, head

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.down(F.gelu(self.up(h))))


def torch_tp(layout, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    V, d, f = 32, 8, 16
    torch.manual_seed(0)
    reference = TinyModel(nn.Embedding(V, d), nn.Linear(d, f), nn.Linear(f, d), nn.Linear(d, V, bias=False))
    full_state = {k: v.clone() for k, v in reference.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(0, V, (2, 12), generator=g), torch.randint(0, V, (2, 12), generator=g)

    # PyTorch's tensor parallelism (DTensor)
    mesh = init_device_mesh("cpu", (layout.tp,))
    theirs = parallelize_module(reference, mesh, {
        "emb": RowwiseParallel(input_layouts=Replicate()),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    logits_theirs = theirs(ids)
    with loss_parallel():
        loss_theirs = F.cross_entropy(logits_theirs.flatten(0, 1), targets.flatten())
        loss_theirs.backward()
    grads_theirs = {n: p.grad.full_tensor() for n, p in theirs.named_parameters()}

    # mambalab's layers, loaded with the same full weights
    ours = TinyModel(VocabParallelEmbedding(V, d, layout), ColumnParallelLinear(d, f, layout=layout),
                     RowParallelLinear(f, d, layout=layout), ColumnParallelLinear(d, V, bias=False, layout=layout))
    load_full_state_dict(ours, full_state, layout.tp_rank)
    logits_ours = ours(ids)
    loss_ours = vocab_parallel_cross_entropy(logits_ours.flatten(0, 1), targets.flatten(), layout).mean()
    loss_ours.backward()
    grads_ours = gather_full(ours, layout.tp, layout.tp_group, grads=True)
    out["logits_diff"] = (logits_ours - logits_theirs.to_local()).abs().max().item()
    out["loss"] = [loss_ours.item(), loss_theirs.full_tensor().item()]
    out["grad_diff"] = _max_diffs(grads_ours, grads_theirs)


if __name__ == "__main__":
    name, out_dir = sys.argv[1], Path(sys.argv[2])
    layout = init_distributed(int(sys.argv[3]) if len(sys.argv) > 3 else 4, timeout_s=60)
    result = {}
    for part in name.split(","):
        result[part] = {}
        {"grads": grads, "torch_tp": torch_tp}[part](layout, result[part])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{layout.rank}.json").write_text(json.dumps(result))
    dist.barrier()   # every rank done before any tears down: rank 0 also hosts the rendezvous store
    dist.destroy_process_group()
