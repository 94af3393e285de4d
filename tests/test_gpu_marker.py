"""Every test that skips on a CPU for lack of CUDA carries the ``gpu`` marker (pyproject.toml), so that
``pytest -m gpu`` (benchmarks/gpu_run.sh's ``gpu-tests`` step) selects them all and ``-m "not gpu"`` none; and
gpu_run.sh itself selects GPU tests by that marker alone, has one timeout, runs no inline Python, lists every step
in its header, and has every step that the READMEs, chapters, tests and scripts quote.

An AST scan of tests/, no import and no collection (well under a second): a GPU skip is a decorator, a
``pytestmark`` or a ``pytest.param(marks=…)`` that is ``requires_gpu`` or a ``skipif`` whose condition or reason
names CUDA or a GPU, or a ``pytest.skip`` under an ``if`` that tests CUDA. Each must sit on a test (or class,
or module) that is marked ``pytest.mark.gpu``, by decorator, class or module ``pytestmark``."""
import ast
import fnmatch
import json
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
GPU_RUN = ROOT / "benchmarks" / "gpu_run.sh"
GPU_WORDS = re.compile(r"cuda|gpu", re.IGNORECASE)


def _text(node) -> str:
    return ast.unparse(node)


# a condition true on a CPU: no CUDA (``not torch.cuda.is_available()``) or the device is the CPU
CPU_ONLY = re.compile(r"\bnot\b.*(cuda|gpu)|==\s*['\"]cpu['\"]", re.IGNORECASE)


def _is_gpu_skip(node) -> bool:
    """``requires_gpu``, or ``pytest.mark.skipif(condition, …)`` whose condition holds without CUDA (a skip
    on the GPU instead, say ``KERNEL_DEVICE != "cpu"``, marks a CPU-only test: not this)."""
    if "requires_gpu" in _text(node):
        return True
    return (isinstance(node, ast.Call) and _text(node.func).endswith("skipif") and bool(node.args)
            and bool(CPU_ONLY.search(_text(node.args[0]))))


def _is_gpu_mark(node) -> bool:
    return bool(re.search(r"\bmark\.gpu\b", _text(node)))


def _marks(value) -> list:
    """The marks a ``pytestmark = …`` or ``marks=…`` holds (one, or a list / tuple of them)."""
    return list(value.elts) if isinstance(value, (ast.List, ast.Tuple)) else [value]


def _skips_in_body(fn) -> bool:
    """``if … cuda …: pytest.skip(…)`` anywhere in the function."""
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and CPU_ONLY.search(_text(node.test)):
            if any(isinstance(c, ast.Call) and _text(c.func).endswith("pytest.skip") for b in node.body
                   for c in ast.walk(b)):
                return True
    return False


def unmarked_gpu_tests(root: Path = TESTS) -> list[str]:
    """"path::name" of every test that skips without CUDA and lacks the gpu marker."""
    missing = []
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module_marks = [m for node in tree.body if isinstance(node, ast.Assign)
                        and any(_text(t) == "pytestmark" for t in node.targets) for m in _marks(node.value)]
        module_gpu = any(_is_gpu_mark(m) for m in module_marks)
        rel = path.relative_to(root.parent)
        if any(_is_gpu_skip(m) for m in module_marks) and not module_gpu:
            missing.append(f"{rel} (module pytestmark)")

        def visit(body, class_gpu, prefix):
            for node in body:
                if isinstance(node, ast.ClassDef):
                    gpu = class_gpu or any(_is_gpu_mark(d) for d in node.decorator_list) or any(
                        _is_gpu_mark(m) for s in node.body if isinstance(s, ast.Assign)
                        and any(_text(t) == "pytestmark" for t in s.targets) for m in _marks(s.value))
                    if any(_is_gpu_skip(d) for d in node.decorator_list) and not gpu:
                        missing.append(f"{rel}::{node.name}")
                    visit(node.body, gpu, f"{node.name}::")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                    marked = module_gpu or class_gpu or any(_is_gpu_mark(d) for d in node.decorator_list)
                    direct = [d for d in node.decorator_list
                              if not (isinstance(d, ast.Call) and _text(d.func).endswith("parametrize"))]
                    if ((any(_is_gpu_skip(d) for d in direct) or _skips_in_body(node))
                            and not marked):
                        missing.append(f"{rel}::{prefix}{node.name}")
                    # a GPU case among CPU ones: pytest.param(…, marks=(requires_gpu, pytest.mark.gpu))
                    params = [[*_marks(kw.value)] for d in node.decorator_list for c in ast.walk(d)
                              if isinstance(c, ast.Call) and _text(c.func).endswith("param")
                              for kw in c.keywords if kw.arg == "marks"]
                    if not marked and any(any(map(_is_gpu_skip, m)) and not any(map(_is_gpu_mark, m))
                                          for m in params):
                        missing.append(f"{rel}::{prefix}{node.name} (a pytest.param's marks)")

        visit(tree.body, False, "")
    return missing


def test_every_test_that_skips_without_cuda_is_marked_gpu():
    missing = unmarked_gpu_tests()
    assert not missing, "skips without CUDA but lacks @pytest.mark.gpu:\n  " + "\n  ".join(missing)


def test_the_scan_finds_each_kind_of_gpu_skip(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest, torch\n"
        "from conftest import requires_gpu\n"
        "@requires_gpu\ndef test_a(): pass\n"
        "@pytest.mark.gpu\n@requires_gpu\ndef test_b(): pass\n"
        "@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\ndef test_c(): pass\n"
        "def test_d():\n    if not torch.cuda.is_available():\n        pytest.skip('no GPU')\n"
        "@pytest.mark.parametrize('dev', [pytest.param('cuda', marks=requires_gpu)])\ndef test_e(dev): pass\n"
        "@pytest.mark.skipif(True, reason='slow')\ndef test_f(): pass\n"
        "class TestG:\n    pytestmark = pytest.mark.gpu\n    @requires_gpu\n    def test_h(self): pass\n"
        "@pytest.mark.skipif(DEVICE != 'cpu', reason='the interpreter, not a GPU')\ndef test_i(): pass\n"
        "@pytest.mark.skipif(DEVICE == 'cpu', reason='x')\ndef test_j(): pass\n"
        "@pytest.mark.parametrize('dev', ['cpu', pytest.param('cuda', marks=(requires_gpu, pytest.mark.gpu))])\n"
        "def test_k(dev): pass\n")
    name = f"{tmp_path.name}/test_sample.py::test_"
    assert unmarked_gpu_tests(tmp_path) == [name + "a", name + "c", name + "d", name + "e (a pytest.param's marks)",
                                            name + "j"]


def _gpu_run_steps(text: str) -> list[str]:
    """The case labels of gpu_run.sh's step loop (patterns such as ``nb-*``), without the catch-all."""
    return [label for m in re.finditer(r"(?m)^ {4}([a-z0-9*|-]+)\)", text) for label in m.group(1).split("|")
            if label != "*"]


def test_gpu_run_selects_gpu_tests_by_the_marker_with_one_timeout_and_no_inline_python():
    text = GPU_RUN.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "run_pytest -v -m gpu tests " in code   # gpu-tests: every marked test
    pytest_calls = re.findall(r"run_pytest (.*)", code)
    assert pytest_calls and not [c for c in pytest_calls if re.search(r"(^|\s)-k\b", c)]
    assert all(c.split("-m ", 1)[1].startswith("gpu ") for c in pytest_calls if "-m " in c)
    assert not re.search(r"python3? -c\b", code)
    settings = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):-", code))
    assert {s for s in settings if "TIMEOUT" in s or s.endswith("_T")} == {"STEP_TIMEOUT"}, settings
    assert not re.search(r"\btimeout \d", code), "a step's timeout is STEP_TIMEOUT's, through within()"


def test_gpu_run_header_lists_every_step_once():
    text = GPU_RUN.read_text()
    header = text[text.index("# Steps"):text.index("\nset -uo")]
    listed = re.findall(r"(?m)^#   ([a-z][a-zA-Z0-9-]*)\*?\s", header)
    steps = _gpu_run_steps(text)
    assert len(listed) == len(set(listed))
    assert [name for name in listed if sum(fnmatch.fnmatchcase(name, s) for s in steps) != 1] == []
    assert [s for s in steps if not any(fnmatch.fnmatchcase(name, s) for name in listed)] == []


def test_every_quoted_gpu_run_step_exists():
    """``bash benchmarks/gpu_run.sh STEP…`` or `` `gpu_run.sh STEP…` `` in the READMEs, the results log, the
    chapters, the tests and the scripts names steps the script has."""
    steps = _gpu_run_steps(GPU_RUN.read_text())
    files = [ROOT / "README.md", ROOT / "benchmarks" / "results" / "README.md", *sorted(TESTS.rglob("*.py")),
             *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.sh"))]
    texts = {f: f.read_text() for f in files}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        texts[nb] = "\n".join("".join(c["source"]) for c in cells)
    quoted = {(f.relative_to(ROOT).as_posix(), word) for f, text in texts.items()
              for m in re.finditer(r"(?:bash benchmarks/|`)gpu_run\.sh((?:\s+[a-z0-9][a-z0-9-]*\b(?![.'/]))+)", text)
              for word in m.group(1).split()}
    assert len(quoted) > 10   # the READMEs and chapters quote many
    unknown = sorted((f, w) for f, w in quoted if not any(fnmatch.fnmatchcase(w, s) for s in steps))
    assert not unknown, f"quoted steps gpu_run.sh lacks: {unknown}"
