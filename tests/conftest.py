"""Shared fixtures. Kernels run on the GPU when there is one, else on the CPU through Triton's interpreter
(importing mambalab switches it on, so it is imported first)."""
import os
from pathlib import Path

import mambalab  # noqa: F401  (before anything imports triton)
import pytest
import torch

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# transformers binds mamba-ssm's kernels when its Mamba modules are first imported, if `import mamba_ssm`
# works at that moment. mambalab.oracle makes it work without mamba-ssm's CUDA extension (a stand-in module
# whose every op raises), so once any test has loaded the oracle, transformers' Mamba would call CUDA-only
# ops on the CPU. Import those modules now, before any test loads the oracle: they bind what a plain
# install gives a user (the CUDA ops where the extension is built, PyTorch's path elsewhere).
try:
    import transformers.models.mamba.modeling_mamba  # noqa: F401
    import transformers.models.mamba2.modeling_mamba2  # noqa: F401
except ImportError:  # transformers is optional for most tests
    pass


@pytest.fixture
def kernel_device() -> str:
    return KERNEL_DEVICE


# fp32 kernels dot in tf32 on a GPU (mambalab.device.dot_precision, as mamba-ssm) and exactly on the CPU, so
# comparisons of an fp32 kernel path with an fp32 PyTorch path use these tolerances.
FP32_KERNEL_TOL = dict(atol=1e-5, rtol=1e-4) if KERNEL_DEVICE == "cpu" else dict(atol=3e-3, rtol=3e-3)

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_ssd_inputs(b, l, h, p, g, n, *, D="h", z=True, bias=True, init=True, dtype=torch.float32,
                    param_dtype=None, seed=0, device="cpu"):
    """Random SSD inputs in mamba_chunk_scan_combined's layout: x, z (b, l, h, p), dt (b, l, h), A (h,),
    B, C (b, l, g, n), D (h,) or (h, p), dt_bias (h,), initial_states (b, h, p, n).

    x, B, C, z are made in ``dtype``; dt, A, D, dt_bias and initial_states in ``param_dtype`` (default
    ``dtype``). D: None, "h" for (h,) or "hp" for (h, p). dt is positive, so it means the same with and
    without softplus."""
    gen = torch.Generator().manual_seed(seed)
    pd = param_dtype or dtype
    act = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    par = lambda *s: torch.randn(*s, generator=gen, dtype=pd)
    x = {
        "x": act(b, l, h, p),
        "dt": 0.05 + 0.45 * torch.rand(b, l, h, generator=gen, dtype=pd),
        "A": -(0.5 + torch.rand(h, generator=gen, dtype=pd)),
        "B": act(b, l, g, n),
        "C": act(b, l, g, n),
        "D": {None: None, "h": par(h), "hp": par(h, p)}[D],
        "z": act(b, l, h, p) if z else None,
        "dt_bias": 0.1 * par(h) if bias else None,
        "initial_states": par(b, h, p, n) if init else None,
    }
    return {k: (v.to(device) if v is not None else None) for k, v in x.items()}


def make_mamba3_inputs(b, l, h, p, g, n, r, a, *, D=True, z=True, init=False, dtype=torch.float64, seed=0,
                       device="cpu"):
    """Random Mamba-3 inputs (mambalab.ref.mamba3's layout), as keyword arguments: q, k (b, l, r, g, n);
    v, z (b, l, h, p); adt (<= 0), dt (> 0), trap (in [0, 1]) (b, l, h); q_bias, k_bias (h, r, n) near 1;
    angles (b, l, h, a) = π·tanh(·); D (h,); mimo_v/z/o (h, r, p) when r > 1; initial_state when ``init``."""
    from mambalab.ref.mamba3 import Mamba3State
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    dt = 0.05 + 0.5 * torch.rand(b, l, h, generator=gen, dtype=dtype)
    x = {
        "q": rn(b, l, r, g, n), "k": rn(b, l, r, g, n), "v": rn(b, l, h, p),
        "adt": -dt * (0.5 + torch.rand(h, generator=gen, dtype=dtype)), "dt": dt,
        "trap": torch.rand(b, l, h, generator=gen, dtype=dtype),
        "q_bias": 1 + 0.1 * rn(h, r, n), "k_bias": 1 + 0.1 * rn(h, r, n),
        "angles": torch.pi * torch.tanh(rn(b, l, h, a)),
        "D": rn(h) if D else None, "z": rn(b, l, h, p) if z else None,
    }
    if r > 1:
        x.update(mimo_v=rn(h, r, p) / r, mimo_z=rn(h, r, p) if z else None, mimo_o=rn(h, r, p) / r)
    x = {k: (t.to(device) if t is not None else None) for k, t in x.items()}
    if init:
        x["initial_state"] = Mamba3State(rn(b, h, a).to(device), rn(b, h, p, n).to(device),
                                         rn(b, h, r, n).to(device), rn(b, h, p).to(device))
    return x


def rotate_halves(x, theta):
    """mamba-ssm's MIMO rotary layout, by mamba-ssm's own reference (apply_rotary_qk_inference_reference with
    rotate_pairwise off, its angle state θ and no increment): the pairs (x[i], x[i + n/2]) turn by θ[i] for
    i < a, the rest stays. x (..., n); theta (..., a) broadcastable to x's leading axes -> (..., n)."""
    from mambalab import oracle

    rotary = oracle.module("ops.triton.mamba3.mamba3_mimo_rotary_step").apply_rotary_qk_inference_reference
    lead = torch.broadcast_shapes(x.shape[:-1], theta.shape[:-1])
    rows = x.expand(*lead, x.shape[-1]).reshape(-1, 1, 1, x.shape[-1])      # its (batch, rank, heads, n)
    angle = theta.expand(*lead, theta.shape[-1]).reshape(-1, 1, theta.shape[-1])
    zero = torch.zeros(rows.shape[0], 1, dtype=x.dtype, device=x.device)
    turned, _, _ = rotary(rows, rows, angle, torch.zeros_like(angle), zero, rotate_pairwise=False)
    return turned.reshape(*lead, x.shape[-1])


# Sizes the tests give chapters whose CPU sizes take a minute or more a run in Triton's interpreter, assigned in a
# cell after the `parameters` cell (tagged "injected-parameters", as papermill's). tests/browser runs every chapter
# named here at these sizes in JupyterLab; tests/test_notebooks.py and the offline pages run the chapters of
# PAPERMILL_SMALLER at them under papermill, and every other chapter at the sizes a reader gets. What the tests
# check (every cell runs, figures draw, sliders redraw, pages render offline, the chapters' own checks) holds at
# these sizes. With a GPU, or with MAMBALAB_UPDATE_PREVIEWS=1 (the previews show what a reader sees), nothing is
# injected. Values are what papermill writes as Python literals (None, bool, int, float, str, list, dict): it
# turns a tuple into its string.
SMALLER_ON_CPU = {
    "02_ssd_chunking": dict(STEPS_L=64, CHECK_L=64, COST_LENGTHS=[128, 256], COST_REPEATS=1),
    "04_atomic_nondeterminism": dict(SSD_SHAPE=[2, 32, 4, 4, 1, 4], SSD_RUNS=2, NORM_ROWS=64, NORM_D=256),
    # one routed library model (tests/test_compat.py steps each of them)
    "05_deterministic_kernels": dict(FP_L=32, FP_BATCHES=[1, 2], TRAIN_STEPS=2, LIBRARY_MODELS=["mamba_ssm.Mamba2"]),
    # two gloo ranks instead of four: TP_DEGREES is derived from NPROC in the parameters cell, so it is given too
    "06_tensor_parallel_training": dict(NPROC=2, TP_DEGREES=[1, 2], CP_DEGREES=[1, 2],
                                       RUN=dict(task="mqar", batch_size=8, seq_len=32, steps=8, lr=3e-3, warmup=3)),
    "07_inference": dict(CHECK_BATCH=1, CHECK_PREFILL=6, CHECK_DECODE=2, NAIVE_TOKENS=16, CORPUS_CHARS=20_000,
                         TRAIN=dict(steps=20, batch_size=16, seq_len=128, lr=4e-3, warmup=5), SAMPLE_CHARS=40),
}
PAPERMILL_SMALLER = ("05_deterministic_kernels", "06_tensor_parallel_training", "07_inference")


def smaller_sizes(path: Path, *, papermill: bool) -> dict:
    """The sizes injected into the chapter at ``path`` (see SMALLER_ON_CPU); {} for none."""
    if torch.cuda.is_available() or os.environ.get("MAMBALAB_UPDATE_PREVIEWS") == "1":
        return {}
    if papermill and path.stem not in PAPERMILL_SMALLER:
        return {}
    return SMALLER_ON_CPU.get(path.stem, {})


# Executing a chapter (papermill) keeps one core busy for up to two minutes while pytest itself only waits, and
# CI has two cores. In one process, the notebooks that the selected tests ask for are executed one after another
# in a background thread from the session's first test, and the tests that read them run last: the same
# executions, beside the rest of the suite instead of in its way. Under pytest-xdist (`./run.sh test` runs two
# workers, --dist loadscope) each worker is a session of its own, so a notebook's readers must share a worker:
# NotebookScopeScheduling gives each notebook's readers one work unit and each module one (its module-scoped
# fixtures are computed once), and a worker executes a notebook when its first reader asks.
_NOTEBOOKS_TO_EXECUTE = pytest.StashKey[list]()
# The modules whose tests read ``executed_notebook``, parametrized by the notebook's path with its stem as id.
NOTEBOOK_READERS = ("tests/test_notebooks.py", "tests/browser/test_pages_offline.py")
# The module that runs each notebook in JupyterLab, its tests parametrized the same way.
LAB_RUNS = "tests/browser/test_workbook_in_browser.py"


def _notebook_params(item) -> list:
    params = getattr(getattr(item, "callspec", None), "params", {}).values()
    return [p for p in params if isinstance(p, Path) and p.suffix == ".ipynb"]


@pytest.hookimpl(trylast=True)   # after -k, -m and --deselect have dropped what will not run
def pytest_collection_modifyitems(config, items):
    """Tests that use ``executed_notebook`` go last, in their order; their notebooks are noted for
    :func:`executed_notebook` to execute from the session's start. Under pytest-xdist they keep their place."""
    reading = [item for item in items if "executed_notebook" in getattr(item, "fixturenames", ())]
    if not reading:
        return
    stray = [item.nodeid for item in reading if item.nodeid.split("::")[0] not in NOTEBOOK_READERS]
    if stray:
        raise pytest.UsageError(f"{stray[0]} reads executed_notebook outside NOTEBOOK_READERS (tests/conftest.py)")
    if hasattr(config, "workerinput"):
        return
    ids = {id(item) for item in reading}
    items[:] = [item for item in items if id(item) not in ids] + reading
    config.stash[_NOTEBOOKS_TO_EXECUTE] = list(dict.fromkeys(p for item in reading for p in _notebook_params(item)))


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist's
def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope with each notebook's readers in one work unit (see NotebookScopeScheduling)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class NotebookScopeScheduling(LoadScopeScheduling):
        """One work unit a module, except that the tests of NOTEBOOK_READERS parametrized by a notebook form
        one unit for that notebook (``notebook:<stem>``), whichever module they are in, and LAB_RUNS' tests
        one unit a notebook (``lab:<stem>``), so that the JupyterLab runs spread over the workers. Units go
        out largest first (loadscope's order), the notebooks' ahead of any module's: each keeps a worker busy
        for a minute or two, so they must not come last."""

        def _split_scope(self, nodeid: str) -> str:
            module, _, rest = nodeid.partition("::")
            ids = rest.rpartition("[")[2].rstrip("]").split("-") if rest.endswith("]") else []
            stems = [i for i in ids if i in NOTEBOOK_STEMS]
            if module in NOTEBOOK_READERS and stems:
                return f"notebook:{stems[0]}"
            if module == LAB_RUNS and stems:
                return f"lab:{stems[0]}"
            return module

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_notebooks_put_first", False):
                for scope in [s for s in self.workqueue if s.startswith(("notebook:", "lab:"))][::-1]:
                    self.workqueue.move_to_end(scope, last=False)
                self._notebooks_put_first = True
            super()._assign_work_unit(node)

    return NotebookScopeScheduling(config, log)


NOTEBOOK_STEMS = {p.stem for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")}


@pytest.fixture(scope="session", autouse=True)
def _execute_notebooks_from_the_start(request):
    """Start :func:`executed_notebook`'s background executions with the session's first test."""
    if request.config.stash.get(_NOTEBOOKS_TO_EXECUTE, None):
        request.getfixturevalue("executed_notebook")


@pytest.fixture(scope="session")
def executed_notebook(request, tmp_path_factory):
    """``executed_notebook(path)``: the notebook at ``path`` executed as ``./run.sh workbook`` executes it
    (papermill, a fresh kernel; the chapters of PAPERMILL_SMALLER with :func:`smaller_sizes` injected), once per
    test session; returns the executed copy.
    tests/test_notebooks.py and the offline-page tests in tests/browser share the run. The notebooks of the
    selected tests are executed one after another in a background thread from the session's start (see
    pytest_collection_modifyitems); asking for one waits for its run. Under pytest-xdist a worker executes a
    notebook when a test first asks for it. A failed run raises its error again for every test that asks for
    that notebook."""
    from concurrent.futures import ThreadPoolExecutor

    from mambalab import workbook

    out = tmp_path_factory.mktemp("executed")
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executed_notebook")
    runs: dict = {}

    def submit(path):
        if path not in runs:
            runs[path] = pool.submit(workbook.execute, path, out, smaller_sizes(path, papermill=True))
        return runs[path]

    for path in request.config.stash.get(_NOTEBOOKS_TO_EXECUTE, []):
        submit(path)
    try:
        yield lambda path: submit(path).result()   # the run's exception, raised again, if it failed
    finally:
        pool.shutdown(wait=True, cancel_futures=True)   # the notebook executing now finishes; none starts
