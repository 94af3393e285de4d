"""Shared fixtures. Kernels run on the GPU when there is one, else on the CPU through Triton's interpreter
(importing mambalab switches it on, so it is imported first)."""
import os
from pathlib import Path

import mambalab  # noqa: F401  (before anything imports triton)
import pytest
import torch

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _share_the_cores() -> None:
    """Under pytest-xdist, give each worker's PyTorch its share of the cores (at least one thread), and the processes
    it starts (notebook kernels, torchrun ranks, the CLI) the same through OMP_NUM_THREADS. With every worker
    running as many threads as there are cores, the threads of one operation wait for a core another worker holds
    (chapter 06's JupyterLab run and tests/test_cli.py, which start processes, slow most). An OMP_NUM_THREADS
    already set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores()

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


def benchmark_module(name: str):
    """The script benchmarks/<name>.py, imported as a module (benchmarks/ is no package; each script puts what it
    imports on sys.path itself)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
# cell after the `parameters` cell (tagged "injected-parameters", as papermill's) by whichever run executes the
# chapter (JupyterLab's or papermill's, see executed_notebook), so every test reads the chapter at these sizes. What
# the tests check (every cell runs, figures draw, sliders redraw, pages render offline, the chapters' own checks)
# holds at these sizes. With a GPU, or with MAMBALAB_UPDATE_PREVIEWS=1 (the previews show what a reader sees),
# nothing is injected. Values are what papermill writes as Python literals (None, bool, int, float, str, list,
# dict): it turns a tuple into its string.
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


def smaller_sizes(path: Path) -> dict:
    """The sizes injected into the chapter at ``path`` (see SMALLER_ON_CPU); {} for none."""
    if torch.cuda.is_available() or os.environ.get("MAMBALAB_UPDATE_PREVIEWS") == "1":
        return {}
    return SMALLER_ON_CPU.get(path.stem, {})


# Each chapter is executed once a test session, and every test that reads it reads that one execution. A chapter
# keeps one core busy for up to two minutes while pytest itself only waits, and CI has two cores.
# * When the chapter's JupyterLab run (LAB_RUNS: Run All Cells in headless Chromium) is among the selected tests and
#   can run (Chromium and Playwright are here), it is the execution: the copy JupyterLab saves, outputs included,
#   is what executed_notebook gives the readers. Playwright's synchronous API belongs to the thread that started
#   it, so the lab run is a test in the foreground: each chapter's lab tests run just before its readers.
# * Otherwise (no Chromium, `-m "not browser"`, tests/test_notebooks.py alone) papermill executes it, as
#   `./run.sh workbook` does. In one process these chapters are executed one after another in a background thread
#   from the session's first test, and their readers run last: the same executions, beside the rest of the suite
#   instead of in its way.
# Under pytest-xdist (`./run.sh test` runs two workers, --dist loadscope) each worker is a session of its own, so a
# chapter's lab run and its readers must share a worker: NotebookScopeScheduling makes them one work unit a chapter
# and each module one (its module-scoped fixtures are computed once), and a worker executes a chapter when its
# first test asks. Under another --dist mode nothing keeps them together, so papermill executes every chapter there.
_PAPERMILL_IN_BACKGROUND = pytest.StashKey[list]()
_EXECUTED_IN_LAB = pytest.StashKey[set]()
# The modules whose tests read ``executed_notebook``, parametrized by the notebook's path with its stem as id.
NOTEBOOK_READERS = ("tests/test_notebooks.py", "tests/browser/test_pages_offline.py")
# The module that runs each notebook in JupyterLab, its tests parametrized the same way.
LAB_RUNS = "tests/browser/test_workbook_in_browser.py"
# workerinput's key saying that NotebookScopeScheduling hands out the work (pytest_configure_node)
_UNITS_KEY = "mambalab_notebook_units"


def _notebook_params(item) -> list:
    params = getattr(getattr(item, "callspec", None), "params", {}).values()
    return [p for p in params if isinstance(p, Path) and p.suffix == ".ipynb"]


def _lab_can_run(config) -> bool:
    """Whether this process runs a chapter's lab tests and its readers together, with a browser to run them."""
    if hasattr(config, "workerinput") and not config.workerinput.get(_UNITS_KEY, False):
        return False
    try:
        import playwright.sync_api  # noqa: F401
        from browser.conftest import find_chromium
    except ImportError:
        return False
    return find_chromium() is not None


@pytest.hookimpl(trylast=True)   # after -k, -m and --deselect have dropped what will not run
def pytest_collection_modifyitems(config, items):
    """The tests that use ``executed_notebook`` and the JupyterLab runs go last, a chapter at a time: its lab
    tests, then its readers (in their order). Notes which chapters JupyterLab executes and which papermill
    executes from the session's start (in one process; under pytest-xdist a worker executes a chapter when its
    first test asks)."""
    reading = [item for item in items if "executed_notebook" in getattr(item, "fixturenames", ())]
    stray = [item.nodeid for item in reading if item.nodeid.split("::")[0] not in NOTEBOOK_READERS]
    if stray:
        raise pytest.UsageError(f"{stray[0]} reads executed_notebook outside NOTEBOOK_READERS (tests/conftest.py)")
    lab = [item for item in items if item.nodeid.split("::")[0] == LAB_RUNS]
    in_lab = {p for item in lab for p in _notebook_params(item)} if lab and _lab_can_run(config) else set()
    config.stash[_EXECUTED_IN_LAB] = in_lab
    if not reading and not lab:
        return
    lab_ids, reader_ids = {id(item) for item in lab}, {id(item) for item in reading}
    chapters: dict = {}   # notebook -> ([its lab tests], [its readers]), in the order they first appear
    for item in items:
        if id(item) in lab_ids or id(item) in reader_ids:
            for path in _notebook_params(item)[:1]:
                chapters.setdefault(path, ([], []))[id(item) in reader_ids].append(item)
    ids = {id(item) for tests, readers in chapters.values() for item in tests + readers}
    items[:] = [item for item in items if id(item) not in ids] + [
        item for tests, readers in chapters.values() for item in tests + readers]
    if not hasattr(config, "workerinput"):
        config.stash[_PAPERMILL_IN_BACKGROUND] = [p for p, (_, readers) in chapters.items()
                                                  if readers and p not in in_lab]


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist's, on the controller
def pytest_configure_node(node):
    node.workerinput[_UNITS_KEY] = node.config.getvalue("dist") == "loadscope"


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist's
def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope with each chapter's lab run and readers in one work unit (see NotebookScopeScheduling)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class NotebookScopeScheduling(LoadScopeScheduling):
        """One work unit a module, except that the tests of NOTEBOOK_READERS and LAB_RUNS parametrized by a
        notebook form one unit for that notebook (``notebook:<stem>``), whichever module they are in: its one
        execution serves them all, and the chapters spread over the workers. Units go out largest first
        (loadscope's order), the notebooks' ahead of any module's: each keeps a worker busy for a minute or two,
        so they must not come last."""

        def _split_scope(self, nodeid: str) -> str:
            module, _, rest = nodeid.partition("::")
            ids = rest.rpartition("[")[2].rstrip("]").split("-") if rest.endswith("]") else []
            stems = [i for i in ids if i in NOTEBOOK_STEMS]
            if (module in NOTEBOOK_READERS or module == LAB_RUNS) and stems:
                return f"notebook:{stems[0]}"
            return module

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_notebooks_put_first", False):
                for scope in [s for s in self.workqueue if s.startswith("notebook:")][::-1]:
                    self.workqueue.move_to_end(scope, last=False)
                self._notebooks_put_first = True
            super()._assign_work_unit(node)

    return NotebookScopeScheduling(config, log)


NOTEBOOK_STEMS = {p.stem for p in (Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb")}


@pytest.fixture(scope="session", autouse=True)
def _execute_notebooks_from_the_start(request):
    """Start :func:`executed_notebook`'s background executions with the session's first test."""
    if request.config.stash.get(_PAPERMILL_IN_BACKGROUND, None):
        request.getfixturevalue("executed_notebook")


@pytest.fixture(scope="session")
def lab_executed() -> dict:
    """The chapters JupyterLab executed in this session (tests/browser/test_workbook_in_browser.py records
    them): notebook path -> the copy JupyterLab saved, or, where its run broke off, why (a str)."""
    return {}


@pytest.fixture(scope="session")
def executed_notebook(request, tmp_path_factory, lab_executed):
    """``executed_notebook(path)``: the notebook at ``path`` executed once per test session, with
    :func:`smaller_sizes` injected after its ``parameters`` cell; returns the executed copy.

    Where this session runs the chapter in JupyterLab (see the notes above NOTEBOOK_READERS), the copy
    is the one JupyterLab saved after Run All Cells: that run is kept rather than a papermill run because it
    alone meets the notebook as a reader does (JupyterLab's front end, its widget manager, sliders driving live
    figures), and its saved copy holds every output a papermill run writes. Elsewhere papermill executes it as
    ``./run.sh workbook`` does, on a fresh kernel. Either way a failed cell raises
    :class:`papermill.exceptions.PapermillExecutionError` (the cell, its error and traceback) for every test that
    asks for that notebook."""
    from concurrent.futures import ThreadPoolExecutor

    from mambalab import workbook

    in_lab = request.config.stash.get(_EXECUTED_IN_LAB, set())
    out = tmp_path_factory.mktemp("executed")
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executed_notebook")
    runs: dict = {}

    def submit(path):
        if path not in runs:
            runs[path] = pool.submit(workbook.execute, path, out, smaller_sizes(path))
        return runs[path]

    def executed(path):
        if path in in_lab:
            return _saved_by_lab(path, lab_executed)
        return submit(path).result()   # the run's exception, raised again, if it failed

    for path in request.config.stash.get(_PAPERMILL_IN_BACKGROUND, []):
        submit(path)
    try:
        yield executed
    finally:
        pool.shutdown(wait=True, cancel_futures=True)   # the notebook executing now finishes; none starts


@pytest.fixture(scope="session")
def rendered_page(tmp_path_factory):
    """``rendered_page(executed)``: the executed notebook at ``executed`` rendered as ``./run.sh workbook`` renders
    it (:func:`mambalab.workbook.render_html`), once a session; returns the page's path. The tests that check a
    chapter's page (tests/test_notebooks.py, tests/browser/) read that one rendering of its one execution."""
    from mambalab import workbook

    pages: dict = {}

    def rendered(executed: Path) -> Path:
        if executed not in pages:
            pages[executed] = workbook.render_html(executed, tmp_path_factory.mktemp("pages"))
        return pages[executed]

    return rendered


def _saved_by_lab(path: Path, lab_executed: dict) -> Path:
    """The copy of ``path`` JupyterLab saved after Run All Cells; raises what papermill would raise for its first
    failed cell (Run All Cells stops there), or why there is no copy."""
    import nbformat
    from papermill.exceptions import PapermillExecutionError

    saved = lab_executed.get(path)
    if saved is None:
        raise RuntimeError(f"{path.name}: JupyterLab did not run it in this session; {LAB_RUNS} runs it just "
                           "before this test, and its errors say why")
    if isinstance(saved, str):
        raise RuntimeError(f"{path.name}: its run in JupyterLab broke off: {saved}")
    nb = nbformat.read(saved, as_version=4)
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                raise PapermillExecutionError(index, cell.execution_count, cell.source, output.ename,
                                              output.evalue, output.traceback)
    unrun = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and c.source.strip() and c.execution_count is None]
    if unrun:
        raise RuntimeError(f"{path.name}: cells {unrun} did not run in JupyterLab")
    return saved
