"""A small text corpus every Python install ships, a character tokenizer and a short training loop: enough to
train a :class:`~mambalab.modules.lm.MambaLM` that really generates, offline (chapter 07).

* :func:`docstring_corpus`: the standard library's docstrings, from a fixed list of modules in a fixed order;
* :class:`CharTokenizer`: one token per character of the text's alphabet;
* :func:`train_char_model`: next-character training with AdamW on random windows of the text.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mambalab.modules.lm import MambaLM

__all__ = ["CORPUS_MODULES", "CharTokenizer", "docstring_corpus", "train_char_model"]


#: The modules whose docstrings form the corpus, in this order: plain-prose documentation, present in every
#: CPython install (no optional C extension among them).
CORPUS_MODULES = ("collections", "functools", "itertools", "os", "os.path", "re", "string", "textwrap", "json",
                  "random", "statistics", "fractions", "decimal", "datetime", "calendar", "heapq", "bisect",
                  "pathlib", "shutil", "tempfile", "glob", "fnmatch", "csv", "argparse", "logging", "inspect",
                  "dataclasses", "enum", "typing", "abc", "contextlib", "copy", "pprint", "difflib", "unittest",
                  "threading", "queue", "subprocess", "socket", "email", "http.client", "urllib.parse", "zipfile",
                  "tarfile", "gzip", "base64", "hashlib", "struct", "array", "io", "codecs", "locale", "gettext",
                  "traceback", "warnings", "weakref", "types", "operator", "numbers", "math", "cmath", "time",
                  "sched", "uuid", "html", "xml.dom.minidom", "ast", "dis", "tokenize", "pdb", "doctest",
                  "timeit", "trace", "platform", "sysconfig", "configparser", "shlex", "getopt")


def docstring_corpus(modules: Sequence[str] = CORPUS_MODULES, max_chars: int | None = None) -> str:
    """The docstrings of ``modules`` and of their public classes, functions and methods (``inspect.getdoc``),
    module by module in the order given, members in alphabetical order, each docstring once; characters
    outside printable ASCII dropped, tabs as spaces. Deterministic for a given Python version. A module
    that fails to import is skipped."""
    import importlib

    seen: set[str] = set()
    pieces: list[str] = []

    def add(obj) -> None:
        doc = inspect.getdoc(obj)
        if doc and doc not in seen:
            seen.add(doc)
            pieces.append(doc)

    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        add(module)
        for member_name in sorted(vars(module)):
            if member_name.startswith("_"):
                continue
            member = vars(module)[member_name]
            if getattr(member, "__module__", None) != module.__name__:
                continue   # re-exported from elsewhere: documented where it lives
            if inspect.isfunction(member) or inspect.isbuiltin(member):
                add(member)
            elif inspect.isclass(member):
                add(member)
                for attr in sorted(vars(member)):
                    if not attr.startswith("_") and inspect.isfunction(vars(member)[attr]):
                        add(vars(member)[attr])
    text = "\n\n".join(pieces).replace("\t", "    ")
    text = "".join(ch for ch in text if ch == "\n" or " " <= ch <= "~")
    return text[:max_chars] if max_chars is not None else text


class CharTokenizer:
    """One token per character of ``text``'s alphabet (sorted): encode str -> ids (int64), decode ids -> str."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"text holds characters outside the tokenizer's alphabet: {unknown}")
        return torch.tensor([self.index[ch] for ch in text], dtype=torch.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in torch.as_tensor(ids).flatten())


def train_char_model(model: MambaLM, data: torch.Tensor, *, steps: int, batch_size: int, seq_len: int,
                     lr: float = 3e-3, warmup: int = 20, seed: int = 0, amp: bool = False,
                     log_every: int = 0) -> list[float]:
    """Next-character training on random windows of ``data`` (ids (N,) on the model's device): AdamW with weight
    decay 0.1 on matrices only, linear warm-up then cosine decay to lr / 10, gradients clipped at norm 1.
    ``amp``: bf16 autocast (on a GPU). The windows come from a generator seeded with ``seed``. Returns the loss
    of every step (nats per character)."""
    import math

    device = data.device
    gen = torch.Generator().manual_seed(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    offsets = torch.arange(seq_len + 1)
    losses = []
    model.train()
    for step in range(steps):
        scale = (step + 1) / warmup if step < warmup else \
            0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size, 1), generator=gen)
        window = data[(starts + offsets).to(device)]                     # (b, seq_len + 1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(window[:, :-1])                               # (b, seq_len, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1:5d}: loss {loss.item():.3f} nats/char")
    model.eval()
    return losses
