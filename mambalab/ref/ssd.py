"""Mamba-2's state-space duality (SSD): one recurrence, computed three ways.

Each head has a scalar decay A (negative) and, at every position t, a step Δ_t > 0. Its state s_t is a
(p, n) matrix, updated and read as

    s_t = exp(Δ_t A) s_{t-1} + Δ_t x_t B_tᵀ        x_t: (p,);  B_t, C_t: (n,)
    y_t = s_t C_t  (+ D x_t)                        then, optionally, y_t ⊙ silu(z_t)

Write a_t = Δ_t A for the log-decay of step t. Unrolling the recurrence from s_{-1} = 0,

    y_t = Σ_{j ≤ t} exp(a_{j+1} + … + a_t) (C_t · B_j) Δ_j x_j

so with the decay matrix L[t, j] = exp(a_{j+1} + … + a_t) for t ≥ j (ones on the diagonal, zero above it)

    Y = (L ∘ C Bᵀ) (Δ ⊙ X)        (l, p) = [(l, l) ∘ (l, n)(n, l)] (l, p)

which is causal linear attention with a decaying mask: the "duality" of the name. Three ways to compute Y
and the final state:

* :func:`ssd_recurrent`  the loop above: l sequential steps of O(p n) work each.
* :func:`ssd_quadratic`  the matrix form: O(l²) work, all of it parallel; no state is formed on the way.
* :func:`ssd_chunked`    the SSD algorithm. Cut the sequence into c chunks of q steps; use the matrix form
  inside chunks and the recurrence between them, so the sequential part has c steps instead of l:
    1. :func:`chunk_diagonal_outputs`  outputs of each chunk from its own inputs (the diagonal blocks of
       L ∘ C Bᵀ; quadratic in q)
    2. :func:`chunk_states`            the state each chunk leaves behind when it starts from zero
    3. :func:`state_passing`           the recurrence over chunks: the state entering every chunk
    4. :func:`chunk_state_outputs`     what the entering state adds to each output of its chunk
                                       (the off-diagonal blocks, in factored form)
  Y = (1) + (4).

Packed sequences (mamba-ssm's ``seq_idx`` (b, l), nondecreasing along l): the state restarts from zero
wherever seq_idx changes, so nothing of one sequence reaches the next; ``initial_states`` is the state before
the sequence numbered 0 (before position 0 if seq_idx[0] = 0, and of no sequence otherwise). The recurrent
form resets s at each change; the quadratic form masks L to the blocks of one sequence, L[t, j] = 0 unless
seq_t = seq_j, and the initial state's term to the positions of sequence 0. :func:`ssd_ref` takes seq_idx with
those two forms, and ``cu_seqlens`` / ``return_varlen_states`` for the state after each sequence's last
position.

Sums of a_k that go into an exp are segment sums (:func:`segsum`), never differences of one long cumsum:
:func:`segsum_naive` shows what goes wrong otherwise.

Shapes (mamba-ssm's layout for ``mamba_chunk_scan_combined``, sequence first):
    x, z            : (b, l, h, p)
    dt              : (b, l, h)
    A               : (h,)
    B, C            : (b, l, g, n) with g dividing h (head i reads group i // (h // g))
    D               : (h,) or (h, p)
    dt_bias         : (h,)
    initial_states  : (b, h, p, n)
    seq_idx         : (b, l) integers;  cu_seqlens: (num_seqs + 1,) integers (b = 1)
    out             : (b, l, h, p) in x's dtype; final_states (b, h, p, n) in fp32
Inside the chunked form, with q the chunk size and c = ceil(l / q): chunked tensors are (b, c, q, ...), i.e.
the sequence axis l becomes the two axes (c, q).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

METHODS = ("chunked", "quadratic", "recurrent")


def _per_head(M: torch.Tensor, h: int) -> torch.Tensor:
    """Grouped B or C -> one row per head: (..., g, n) -> (..., h, n); head i reads group i // (h // g)."""
    g = M.shape[-2]
    return M.repeat_interleave(h // g, dim=-2)


def _lower_triangle(T: int, device, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril(diagonal)


# ---------------------------------------------------------------------------------------------- segment sums
def segsum(a: torch.Tensor) -> torch.Tensor:
    """Segment sums of ``a`` along its last axis, computed stably.

    a: (..., T) -> (..., T, T) with

        out[..., i, j] = a[j+1] + … + a[i]     for i ≥ j  (0 on the diagonal)
                       = -inf                  for i < j

    so that exp(segsum(a)) is the decay matrix L: lower triangular, ones on the diagonal.

    Each entry is the sum of its own few terms and nothing else: copy ``a`` into every column, zero in column
    j the terms k ≤ j, and take a cumulative sum down the rows. Its rounding error is that of the short sum,
    however large the running total of a before j.
    """
    T = a.shape[-1]
    terms = a.unsqueeze(-1).expand(*a.shape, T)                               # (..., T, T): terms[k, j] = a[k]
    terms = terms.masked_fill(~_lower_triangle(T, a.device, -1), 0.0)        # keep a[k] for k > j only
    sums = terms.cumsum(dim=-2)                                               # (..., T, T): Σ_{j < k ≤ i} a[k]
    return sums.masked_fill(~_lower_triangle(T, a.device), float("-inf"))


def segsum_naive(a: torch.Tensor) -> torch.Tensor:
    """Segment sums as differences of one running sum: out[i, j] = cs[i] - cs[j] with cs = cumsum(a).

    Same shapes and, in exact arithmetic, the same values as :func:`segsum`. Kept to show why it is not used:
    the running sum cs grows with the sequence (a = Δ A < 0, so it falls without bound), and the difference
    of two large, nearly equal numbers keeps little but their rounding errors.

    * Lost precision. Every entry carries an absolute error of about ulp(|cs|) (about 1e-3 once |cs| reaches
      1e4 in fp32), which swamps small segment sums: slowly decaying heads and nearby positions, exactly
      where L is close to 1 and matters most. A step smaller than ulp(|cs|) / 2 vanishes from cs altogether,
      so after a long stretch of strong decay a slowly decaying stretch seems not to decay at all.
    * Overflow. Once cs leaves the range of its dtype (fp16: beyond -65504) it becomes -inf, and
      -inf - (-inf) = NaN, even on the diagonal where the answer is 0. The factored form
      L[i, j] = exp(cs[i]) · exp(-cs[j]), which splitting L into two rank-one factors suggests, fails far
      sooner: exp(-cs[j]) is inf in fp32 once |cs| > 88, and 0 · inf = NaN.
    """
    T = a.shape[-1]
    cs = a.cumsum(dim=-1)                                                     # (..., T)
    diff = cs.unsqueeze(-1) - cs.unsqueeze(-2)                                # (..., T, T): cs[i] - cs[j]
    return diff.masked_fill(~_lower_triangle(T, a.device), float("-inf"))


# ---------------------------------------------------------------------------------------------- step sizes
def effective_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                 dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """Δ as mamba-ssm's kernels form it, in fp32: clamp(softplus(dt + dt_bias), *dt_limit).

    dt: (b, l, h); dt_bias: (h,). The clamp is always applied, as the kernels do: with the default limits it
    only matters without softplus, where a negative dt becomes 0 (the step is skipped). Steps outside the
    limits get no gradient.
    """
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)  # linear above 20, as in the kernels
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


# ---------------------------------------------------------------------------------------------- recurrent form
def ssd_step(state, x_t, dt_t, A, B_t, C_t):
    """One step of the recurrence, as used when decoding token by token (no D skip).

    state: (b, h, p, n); x_t: (b, h, p); dt_t: (b, h) (Δ, already processed); A: (h,); B_t, C_t: (b, g, n)
    -> (new state (b, h, p, n), y_t (b, h, p)).
    """
    h = x_t.shape[1]
    B_t, C_t = _per_head(B_t, h), _per_head(C_t, h)                           # (b, h, n)
    decay = torch.exp(dt_t * A)                                               # (b, h)
    new_input = (dt_t.unsqueeze(-1) * x_t).unsqueeze(-1) * B_t.unsqueeze(-2)  # (b, h, p, n): Δ x Bᵀ
    state = decay[..., None, None] * state + new_input                       # (b, h, p, n)
    y_t = torch.einsum("bhpn,bhn->bhp", state, C_t)                           # (b, h, p): s C
    return state, y_t


def last_positions(cu_seqlens) -> list:
    """Each packed sequence's last position from ``cu_seqlens`` (num_seqs + 1,), None for an empty sequence."""
    bounds = [int(v) for v in cu_seqlens]
    return [e - 1 if e > s else None for s, e in zip(bounds, bounds[1:])]


def ssd_recurrent(x, dt, A, B, C, initial_states=None, seq_idx=None, states_at=None):
    """The recurrence, one step after another: l sequential steps. No D, no z.

    x: (b, l, h, p); dt: (b, l, h) (Δ, already processed); A: (h,); B, C: (b, l, g, n);
    initial_states: (b, h, p, n) or None (zeros); seq_idx: (b, l) or None, the state reset to zero before every
    position whose sequence differs from the previous one's (the one before position 0 counts as sequence 0)
    -> (y (b, l, h, p), final state (b, h, p, n)). With ``states_at`` (a list of positions) a third result:
    the states after those positions, (len(states_at), b, h, p, n) (None for a zero state: an empty sequence's).
    """
    b, l, h, p = x.shape
    n = B.shape[-1]
    state = x.new_zeros(b, h, p, n) if initial_states is None else initial_states
    kept = {}
    ys = []
    for t in range(l):
        if seq_idx is not None:
            before = seq_idx[:, t - 1] if t > 0 else torch.zeros_like(seq_idx[:, 0])
            state = torch.where((seq_idx[:, t] == before)[:, None, None, None], state, torch.zeros_like(state))
        state, y_t = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y_t)
        kept[t] = state
    y = torch.stack(ys, dim=1)                                                # (b, l, h, p)
    if states_at is None:
        return y, state
    return y, state, torch.stack([torch.zeros_like(state) if t is None else kept[int(t)]   # (k, b, h, p, n)
                                  for t in states_at])


# ---------------------------------------------------------------------------------------------- quadratic form
def ssd_quadratic(x, dt, A, B, C, initial_states=None, seq_idx=None):
    """The matrix ("attention") form Y = (L ∘ C Bᵀ)(Δ ⊙ X): O(l²) work, no sequential steps. No D, no z.

    Same arguments and results as :func:`ssd_recurrent` (without ``states_at``). The final state is the one row
    of L it needs: s_{l-1} = Σ_j L[l-1, j] Δ_j x_j B_jᵀ. An initial state s_{-1} adds exp(a_0 + … + a_t)
    C_t · s_{-1} to output t and exp(a_0 + … + a_{l-1}) s_{-1} to the final state. With ``seq_idx``, L[t, j] is
    kept where seq_t = seq_j and the initial state's terms where seq_t = 0.
    """
    h = x.shape[2]
    B, C = _per_head(B, h), _per_head(C, h)                                   # (b, l, h, n)
    a = (dt * A).transpose(1, 2)                                              # (b, h, l): log-decay per step
    L = torch.exp(segsum(a))                                                  # (b, h, l, l): L[t, s]
    if seq_idx is not None:
        same = (seq_idx[:, :, None] == seq_idx[:, None, :])[:, None]          # (b, 1, l, l)
        L = L.masked_fill(~same, 0.0)
    scores = torch.einsum("bthn,bshn->bhts", C, B) * L                        # (b, h, l, l): L ∘ C Bᵀ
    y = torch.einsum("bhts,bsh,bshp->bthp", scores, dt, x)                    # (b, l, h, p)
    final = torch.einsum("bhs,bsh,bshp,bshn->bhpn", L[..., -1, :], dt, x, B)  # (b, h, p, n)
    if initial_states is not None:
        # exp of a plain cumsum is fine here: nothing is subtracted, the decay only shrinks towards 0.
        decay_from_start = torch.exp(a.cumsum(dim=-1))                        # (b, h, l)
        if seq_idx is not None:
            decay_from_start = decay_from_start * (seq_idx == 0)[:, None, :]   # sequence 0's positions only
        y = y + torch.einsum("bht,bthn,bhpn->bthp", decay_from_start, C, initial_states)
        final = final + decay_from_start[..., -1, None, None] * initial_states
    return y, final


# ---------------------------------------------------------------------------------------------- chunked form
def split_into_chunks(x, dt, A, B, C, chunk_size):
    """The inputs of the chunked form: sequence axis l -> (c, q), B and C per head, and a = Δ A.

    x: (b, l, h, p); dt: (b, l, h); A: (h,); B, C: (b, l, g, n) ->
    x (b, c, q, h, p), dt (b, c, q, h), a (b, c, q, h), B, C (b, c, q, h, n), with c = ceil(l / q).

    When q does not divide l the end is padded with zeros. A padded step has Δ = 0: it neither decays the
    state nor adds to it, so the final state is unchanged; its outputs are cropped by the caller.
    """
    b, l, h, p = x.shape
    q = chunk_size
    c = -(-l // q)
    pad = c * q - l

    def chunked(t):  # (b, l, ...) -> (b, c, q, ...)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, c, q, *t.shape[2:])

    B, C = _per_head(B, h), _per_head(C, h)                                   # (b, l, h, n)
    x, dt, B, C = chunked(x), chunked(dt), chunked(B), chunked(C)
    a = dt * A                                                                # (b, c, q, h)
    return x, dt, a, B, C


def chunk_diagonal_outputs(x, dt, a, B, C):
    """Step 3, first part: each chunk's outputs from its own inputs, the matrix form inside every chunk.

    Y_diag[c] = (L_c ∘ C_c B_cᵀ)(Δ_c ⊙ X_c), L_c the q × q decay matrix of chunk c.
    x: (b, c, q, h, p); dt, a: (b, c, q, h); B, C: (b, c, q, h, n) -> (b, c, q, h, p).
    """
    L = torch.exp(segsum(a.permute(0, 3, 1, 2)))                              # (b, h, c, q, q): L[t, s]
    scores = torch.einsum("bcthn,bcshn->bhcts", C, B) * L                     # (b, h, c, q, q)
    return torch.einsum("bhcts,bcsh,bcshp->bcthp", scores, dt, x)             # (b, c, q, h, p)


def chunk_states(x, dt, a, B):
    """Step 1: the state each chunk leaves behind when it starts from zero.

    states[c] = Σ_s exp(a_{s+1} + … + a_{q-1}) Δ_s x_s B_sᵀ over the steps s of chunk c; the weights are the
    last row of the chunk's decay matrix L_c.
    x: (b, c, q, h, p); dt, a: (b, c, q, h); B: (b, c, q, h, n) -> (b, c, h, p, n).
    """
    decay_to_end = torch.exp(segsum(a.permute(0, 3, 1, 2))[..., -1, :])       # (b, h, c, q)
    return torch.einsum("bhcs,bcsh,bcshp,bcshn->bchpn", decay_to_end, dt, x, B)


def state_passing(states, chunk_decay, initial_states=None):
    """Step 2: the recurrence over chunks, c sequential steps.

    S_0 = initial_states (or zeros);  S_{i+1} = exp(chunk_decay_i) S_i + states_i,  where chunk_decay_i is the
    total log-decay a summed over chunk i. S_i is the state entering chunk i; S_c is the final state.
    states: (b, c, h, p, n); chunk_decay: (b, c, h); initial_states: (b, h, p, n) or None
    -> (entering states (b, c, h, p, n), final state (b, h, p, n)).
    """
    S = torch.zeros_like(states[:, 0]) if initial_states is None else initial_states  # (b, h, p, n)
    entering = []
    for i in range(states.shape[1]):
        entering.append(S)
        S = torch.exp(chunk_decay[:, i])[..., None, None] * S + states[:, i]
    return torch.stack(entering, dim=1), S                                    # (b, c, h, p, n), (b, h, p, n)


def chunk_state_outputs(C, entering, a):
    """Step 3, second part: what the state entering each chunk adds to that chunk's outputs.

    Y_off[c, t] = exp(a_0 + … + a_t) S_c C_t, the decay from the chunk's start to step t (inclusive).
    C: (b, c, q, h, n); entering: (b, c, h, p, n); a: (b, c, q, h) -> (b, c, q, h, p).
    """
    decay_from_start = torch.exp(a.cumsum(dim=2))                             # (b, c, q, h); nothing subtracted
    return torch.einsum("bcth,bcthn,bchpn->bcthp", decay_from_start, C, entering)


def ssd_chunked(x, dt, A, B, C, chunk_size, initial_states=None):
    """The SSD algorithm over chunks of ``chunk_size`` (q) steps, numbered as the kernels number them
    (:mod:`mambalab.kernels.ssd`): step 0 splits into chunks and sums the log-decays, 1 the chunk states, 2 the
    recurrence over chunks, 3 the outputs (inside each chunk, then from the entering state). No D, no z.

    Same arguments and results as :func:`ssd_recurrent`, plus the chunk size; any l works (padded inside).
    """
    l = x.shape[1]
    x, dt, a, B, C = split_into_chunks(x, dt, A, B, C, chunk_size)            # step 0: (b, c, q, ...)
    states = chunk_states(x, dt, a, B)                                        # (b, c, h, p, n)
    y_diag = chunk_diagonal_outputs(x, dt, a, B, C)                           # (b, c, q, h, p)
    entering, final = state_passing(states, a.sum(dim=2), initial_states)     # (b, c, h, p, n), (b, h, p, n)
    y_off = chunk_state_outputs(C, entering, a)                               # (b, c, q, h, p)
    y = (y_diag + y_off).flatten(1, 2)[:, :l]                                 # (b, l, h, p): padding cropped
    return y, final


# ---------------------------------------------------------------------------------------------- public entry
def ssd_ref(x, dt, A, B, C, chunk_size=None, D=None, z=None, dt_bias=None, initial_states=None,
            dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, method="chunked",
            seq_idx=None, cu_seqlens=None, return_varlen_states=False):
    """SSD with mamba-ssm's ``mamba_chunk_scan_combined`` arguments (see the module docstring for shapes).

    Forms Δ with :func:`effective_dt`, runs one of the three forms (``method``: "chunked", which needs
    ``chunk_size``, "quadratic" or "recurrent"), then adds D x and gates with silu(z). Computes in fp32;
    returns out in x's dtype, and with ``return_final_states`` also the final state in fp32.

    Packed sequences: ``seq_idx`` (b, l) with "quadratic" or "recurrent" (module docstring). With
    ``return_varlen_states`` (method "recurrent", b = 1) also the state after each sequence's last position
    cu_seqlens[i + 1] - 1, (num_seqs, h, p, n) fp32, last: (out, [final_states], varlen_states), mamba-ssm's order.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if seq_idx is not None and method == "chunked":
        raise ValueError("seq_idx needs method='quadratic' or 'recurrent'")
    if return_varlen_states and (method != "recurrent" or cu_seqlens is None or x.shape[0] != 1):
        raise ValueError("return_varlen_states needs method='recurrent', cu_seqlens and b = 1")
    if method == "chunked" and (chunk_size is None or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int for method='chunked', got {chunk_size!r}")
    h, g = x.shape[2], B.shape[2]
    if h % g:
        raise ValueError(f"the groups of B and C (g = {g}) must divide the heads of x (h = {h})")

    dtype_in = x.dtype
    x, A, B, C = x.float(), A.float(), B.float(), C.float()
    dt = effective_dt(dt, dt_bias, dt_softplus, dt_limit)                     # (b, l, h)
    if initial_states is not None:
        initial_states = initial_states.float()
    varlen = None
    if method == "chunked":
        y, final = ssd_chunked(x, dt, A, B, C, chunk_size, initial_states)
    elif method == "quadratic":
        y, final = ssd_quadratic(x, dt, A, B, C, initial_states, seq_idx)
    elif return_varlen_states:
        ends = last_positions(cu_seqlens)
        y, final, varlen = ssd_recurrent(x, dt, A, B, C, initial_states, seq_idx, states_at=ends)
        varlen = varlen[:, 0]                                                 # (num_seqs, h, p, n)
    else:
        y, final = ssd_recurrent(x, dt, A, B, C, initial_states, seq_idx)
    if D is not None:
        D = D.float()
        y = y + x * (D.unsqueeze(-1) if D.dim() == 1 else D)                  # D: (h, 1) or (h, p)
    if z is not None:
        y = y * F.silu(z.float())
    out = y.to(dtype_in)
    results = (out,) + ((final,) if return_final_states else ()) + ((varlen,) if return_varlen_states else ())
    return results if len(results) > 1 else out
