"""Input validation at the public boundary: the one set of checks every op uses.

Each check raises before any kernel launches, with a message that names the argument and says what was
expected: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, device or value.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
T = TypeVar("T")


def _tensor_of(name: str, x, dtypes: Iterable[torch.dtype]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dtypes = tuple(dtypes)
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}; got {str(x.dtype).replace('torch.', '')}")
    return x


def tensor(name: str, x, *, dtypes: Iterable[torch.dtype] = FLOAT_DTYPES) -> torch.Tensor:
    """``x`` must be a real floating tensor of one of ``dtypes``."""
    if isinstance(x, torch.Tensor) and x.is_complex():
        raise TypeError(f"{name} must be real; complex tensors ({x.dtype}) are not supported")
    return _tensor_of(name, x, dtypes)


def shape(name: str, x: torch.Tensor, expected: Sequence[int | None], meaning: str) -> None:
    """``x.shape`` must equal ``expected`` (None matches any size). ``meaning`` spells the dims, e.g.
    "(b, d, l)"."""
    got = tuple(x.shape)
    ok = len(got) == len(expected) and all(e is None or e == s for e, s in zip(expected, got))
    if not ok:
        want = tuple("?" if e is None else e for e in expected)
        raise ValueError(f"{name} must have shape {meaning} = {want}; got {got}")


def one_token(name: str, x: torch.Tensor, d_model: int) -> None:
    """A decoding step's input: ``x`` of shape (b, 1, d_model)."""
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != d_model:
        raise ValueError(f"step takes one token: {name} of shape (b, 1, d_model={d_model}); got {tuple(x.shape)}")


def token_ids(name: str, ids, vocab_size: int) -> None:
    """``ids`` must be an integer tensor of shape (b, l) with every id in [0, vocab_size). The range check reads
    two numbers back from the device, except while a CUDA graph is captured (nothing can be read then; the
    eager runs that warm a graph up are checked)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids (torch.long or torch.int), got {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must have shape (b, l); got {tuple(ids.shape)}")
    if ids.numel() == 0 or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    low, high = (int(v) for v in torch.aminmax(ids))
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} must lie in [0, {vocab_size}) (the vocabulary size); got ids from {low} to {high}")


def same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors (None ignored) must be on one device; returns it."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for k, v in items[1:]:
        if v.device != first.device:
            raise ValueError(f"{k} is on {v.device} but {first_name} is on {first.device}; "
                             "all inputs must be on the same device")
    return first.device


class Finite:
    """The check that ``x`` holds no NaN or infinity, in two halves, so that an op need not wait for the GPU
    while it still has Python to run.

    Constructing it queues one reduction over ``x`` on its device (the minimum and maximum: a NaN propagates
    into both, an infinity shows in one); :meth:`check` waits for those two numbers and raises. An op builds
    it with its other checks and calls :meth:`check` just before it launches its kernels: the wait is a
    device-to-host copy, and whatever Python runs after it is time the GPU sits idle (with nothing queued
    behind the check, the GPU waits for the launch). ``torch.isfinite(x).all()`` costs five passes on a GPU
    for a bf16 tensor (abs, two compares, an and, the reduction); the check is one
    (0.03 ms against 0.13 in a selective-scan forward at b8 d2048 l2048: benchmarks/results/README.md, 2026-11-30).

    While a CUDA graph is being captured nothing can be read back, so the check is skipped there: a captured
    step (the decode loop's CUDA graph) is checked on the eager runs that warm it up, and replays values its
    caller writes into the graph's inputs.
    """

    def __init__(self, name: str, x: torch.Tensor):
        self.name = name
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        x = distinct_elements(x)
        self._bounds = torch.stack(torch.aminmax(x)) if x.numel() and not capturing else None

    def check(self) -> None:
        if self._bounds is not None and not all(math.isfinite(v) for v in self._bounds.tolist()):
            raise ValueError(f"{self.name} contains NaN or infinite values")


def records_autograd(*tensors) -> bool:
    """Whether autograd would record an op on these inputs: grad mode on and one of them requires grad
    (None and anything not a tensor left out)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def decoding_only(op: str, *tensors, hint: str = "") -> None:
    """A decoding kernel has no backward: refuse inputs that autograd would record, naming ``op``."""
    if records_autograd(*tensors):
        raise NotImplementedError(f"{op} is a decoding kernel without a backward and an input requires grad: call "
                                  f"it under torch.no_grad(){hint}")


INDEX_DTYPES = (torch.int32, torch.int64)


def index_tensor(name: str, x, *, dtypes: Iterable[torch.dtype] = INDEX_DTYPES) -> torch.Tensor:
    """``x`` must be an integer tensor (positions or indices) of one of ``dtypes``."""
    return _tensor_of(name, x, dtypes)


def cu_seqlens(x, like_name: str, like: torch.Tensor) -> list[int]:
    """``x`` must be packed sequences' bounds: an integer (num_seqs + 1,) tensor, num_seqs >= 1, on the device
    of ``like`` (named ``like_name``). Returns them as ints (read back: the tensor is small); the rules on their
    values are each op's."""
    index_tensor("cu_seqlens", x)
    if x.dim() != 1 or x.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape (num_seqs + 1,) with num_seqs >= 1; got {tuple(x.shape)}")
    if x.device != like.device:
        raise ValueError(f"cu_seqlens is on {x.device} but {like_name} is on {like.device}; all inputs must be on "
                         "the same device")
    return x.tolist()


class Nondecreasing:
    """The check that the sequence indices ``x`` never decrease along its last axis, negative ones (padding, as
    mamba-ssm's -1) left out: each index at least every nonnegative one before it. In two halves as
    :class:`Finite`: building it queues a running maximum, a comparison and a reduction on ``x``'s device,
    :meth:`check` reads the answer and raises naming ``name``. Skipped while a CUDA graph is captured."""

    def __init__(self, name: str, x: torch.Tensor):
        self.name = name
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        self._drops = None
        if x.shape[-1] > 1 and not capturing:
            before = torch.cummax(x, dim=-1).values[..., :-1]        # the largest index up to each position
            now = x[..., 1:]
            self._drops = ((now >= 0) & (now < before)).any()

    def check(self) -> None:
        if self._drops is not None and bool(self._drops):
            raise ValueError(f"{self.name} must be nondecreasing along its last axis, negative indices (padding) "
                             "aside: each sequence's positions together, in order; it decreases somewhere")


def distinct_elements(x: torch.Tensor) -> torch.Tensor:
    """A view of ``x`` without its broadcast axes (stride 0, size > 1: an ``expand``), each narrowed to its
    first index. It holds every value ``x`` holds, and no more elements than ``x``'s storage: a check that
    reads it never reads (or copies) an expanded tensor's repeats."""
    for dim, (size, stride) in enumerate(zip(x.shape, x.stride())):
        if stride == 0 and size > 1:
            x = x.narrow(dim, 0, 1)
    return x


def finite(name: str, x: torch.Tensor) -> None:
    """``x`` must hold no NaN or infinity (:class:`Finite`, checked at once)."""
    Finite(name, x).check()


def positive_int(name: str, value, *, power_of_two: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    if power_of_two and value & (value - 1):
        raise ValueError(f"{name} must be a power of two; got {value}")
    return value


MAX_CHUNKS = 65_535   # CUDA's cap on a launch grid's second and third axes, where the chunked kernels put chunks


def chunk_count(l: int, chunk_size: int) -> int:
    """The chunks of a sequence of ``l`` positions (steps), which the chunked kernels launch one program row
    each on a grid axis that CUDA caps at :data:`MAX_CHUNKS`; more is an error here, not a failed launch."""
    chunks = -(-l // chunk_size)
    if chunks > MAX_CHUNKS:
        enough = 1 << (-(-l // MAX_CHUNKS) - 1).bit_length()   # the smallest power of two that would do
        raise ValueError(f"l = {l} at chunk_size = {chunk_size} makes {chunks} chunks; the kernels take at most "
                         f"{MAX_CHUNKS} (a CUDA launch grid's limit): use chunk_size = {enough} or more, or "
                         "split the sequence and carry the state between the parts")
    return chunks


GRID_LIMITS = (2**31 - 1, 65_535, 65_535)   # CUDA's caps on a launch grid's axes 0, 1 and 2
INT32_MAX = 2**31 - 1                          # the largest offset a kernel's 32-bit index arithmetic reaches


def _fit(value: int, count: int, limit: int) -> int:
    """The largest size that keeps ``count`` (which grows in proportion to ``value``, or a little slower, as
    a ceiling division does) within ``limit``: a lower bound, never a size that would still fail."""
    return value * limit // count


def launch_grid(kernel: str, grid: Sequence[int], sizes: Sequence[tuple[str, int]],
                hint: str = "") -> None:
    """Each axis of ``kernel``'s launch grid within CUDA's caps (:data:`GRID_LIMITS`), checked before the launch.

    ``grid``: the programs on each axis, as the launcher computes them. ``sizes``: per axis, the argument size
    that sets it, as (what, value), e.g. ("h (x.shape[2])", 65536), so that the error says what is too large
    and which value would fit; ``hint``: what else the caller can do (ends the message).
    """
    for axis, (programs, cap, size) in enumerate(zip(grid, GRID_LIMITS, sizes)):
        if programs <= cap:
            continue
        what, value = size
        raise ValueError(f"{what} = {value:,} is too large for {kernel}: it launches {programs:,} programs on "
                         f"grid axis {axis}, and CUDA takes at most {cap:,} there; {what} = "
                         f"{_fit(value, programs, cap):,} or less would fit{hint}")


def int32_offsets(what: str, count: int, size: tuple[str, int], hint: str = "") -> None:
    """``count`` (the elements, or rows, of a tensor that a kernel indexes with 32-bit integers) must stay
    within :data:`INT32_MAX`, or the offsets wrap around: checked before the tensor is even allocated.

    ``what`` names the tensor and its layout; ``size``: the argument size to reduce, as (what, value).
    """
    if count <= INT32_MAX:
        return
    name, value = size
    raise ValueError(f"{what} would have {count:,} entries, more than the {INT32_MAX:,} the kernels index with "
                     f"32-bit offsets: {name} = {value:,} is too large; {name} = "
                     f"{_fit(value, count, INT32_MAX):,} or less would fit{hint}")


def available_bytes(device: torch.device) -> int | None:
    """The bytes ``device`` can still allocate: on a GPU, the driver's free memory plus what torch's caching
    allocator holds unused; on the CPU, the kernel's MemAvailable (/proc/meminfo). None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def copies_fit(op: str, device: torch.device, copies: Sequence[tuple[str, torch.Tensor, torch.dtype]],
               outputs: int, hint: str = "") -> None:
    """The contiguous copies an op makes of its inputs, and its ``outputs`` bytes, must fit ``device``'s
    available memory (:func:`available_bytes`), checked before anything is allocated.

    ``copies``: (name, tensor, the dtype the kernels read it in); a contiguous tensor already in that dtype is
    read in place and costs nothing. An expanded view (stride 0) of one element stands for a tensor of its full
    size once copied: the check names it, rather than leave the allocator to fail mid-op. Only what the op is
    certain to hold at once is counted, so a refusal here is never a call that would have fitted; with nothing
    to copy there is nothing to check (and no memory query on the op's path)."""
    copied = [(name, t.numel() * torch.empty((), dtype=dt).element_size()) for name, t, dt in copies
              if t is not None and not (t.is_contiguous() and t.dtype == dt)]
    if not copied:   # inputs read in place: an output that does not fit is the allocator's ordinary error
        return
    need = sum(size for _, size in copied) + outputs
    free = available_bytes(device)
    if free is None or need <= free:
        return
    views = ", ".join(f"{name} ({size / 1e9:.1f} GB)" for name, size in sorted(copied, key=lambda c: -c[1])
                      if size >= need / 20)   # the copies that matter
    raise ValueError(f"{op} needs {need / 1e9:.1f} GB before its kernels run, {device} has {free / 1e9:.1f} GB "
                     f"available: contiguous copies of {views or 'nothing'} (the kernels read contiguous rows; "
                     f"an expanded or strided view is copied at its full size) and {outputs / 1e9:.1f} GB of "
                     f"outputs{hint}")


class SignatureCache:
    """Remembers the argument signatures a metadata-only check accepted, so that a loop calling an op with
    same-shaped inputs (a decoding step per token) runs the check once rather than every call.

    A signature is the shape, dtype and device of each tensor (None for an absent one) and each extra value
    with its type (16.0 == 16 and True == 1, with equal hashes: a float or bool chunk size after an int one
    must still meet the check that refuses it); a check whose outcome depends on nothing else gives the same
    answer for the same signature, so skipping it loses no error. Checks that read values (:func:`finite`)
    must not be cached. At most ``size`` signatures are kept.
    """

    def __init__(self, size: int = 64):
        self._size = size
        self._seen: dict[tuple, object] = {}

    def check(self, tensors: Iterable, run: Callable[[], T], extra: tuple = ()) -> T:
        """``run()``'s result for these tensors' signature: computed on the first call with that signature
        (raising as ``run`` raises), remembered after. ``extra``: the other values ``run`` checks (say a chunk
        size), part of the signature."""
        try:
            key = (tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors)
                   + tuple((type(v), v) for v in extra))
            seen = key in self._seen
        except (AttributeError, TypeError):   # not all tensors, or an unhashable value: the check will say which
            return run()
        if not seen:
            result = run()
            if len(self._seen) >= self._size:
                self._seen.clear()
            self._seen[key] = result
        return self._seen[key]
