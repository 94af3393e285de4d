"""The ``mambalab`` command: ``doctor`` (text and --json), ``workbook`` end to end, and ``--help``."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from mambalab import cli, doctor  # mambalab before triton: it may switch the interpreter on
import triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("mambalab")  # the console script pyproject declares


def run(*args, env=None, script=None, timeout=300):
    cmd = [str(script)] if script else [sys.executable, "-m", "mambalab"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_help_lists_the_subcommands():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    assert "doctor" in result.stdout and "workbook" in result.stdout
    result = run("workbook", "--help")
    assert result.returncode == 0 and "--only" in result.stdout and "--output-dir" in result.stdout


def test_no_subcommand_is_an_error():
    result = run()
    assert result.returncode == 2 and "COMMAND" in result.stderr


def test_doctor_json_from_the_console_script():
    assert SCRIPT.exists(), f"console script missing at {SCRIPT}; run ./run.sh setup"
    result = run("doctor", "--json", script=SCRIPT, env={"MAMBA_DETERMINISTIC": "1"})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # stdout holds the JSON alone
    assert set(report) >= {"versions", "mamba_ssm_cuda_extension", "device", "triton_interpreter",
                           "determinism", "env"}
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert set(report["versions"]) >= {"triton", "mamba_ssm"}
    assert isinstance(report["mamba_ssm_cuda_extension"], bool), report["mamba_ssm_error"]
    gpu = torch.cuda.is_available()
    assert report["device"]["kind"] == ("cuda" if gpu else "cpu")
    assert set(report["device"]) >= {"name", "compute_capability", "sm_count"}
    assert (report["device"]["sm_count"] is not None) == gpu
    assert report["triton_interpreter"] == (not gpu)  # importing mambalab switches it on without a GPU
    assert set(report["determinism"]) == {"torch_deterministic_algorithms", "cuda_matmul_allow_tf32",
                                          "cudnn_allow_tf32", "cudnn_deterministic"}
    assert all(isinstance(v, bool) for v in report["determinism"].values())
    assert set(report["env"]) == set(doctor.ENV_VARS)
    assert report["env"]["MAMBA_DETERMINISTIC"] == "1"  # read from the environment in force


def test_doctor_text_reports_settings_in_force(capsys, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert cli.main(["doctor"]) == 0
    finally:
        torch.use_deterministic_algorithms(previous)
    out = capsys.readouterr().out
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines() if line.startswith("  "))
    assert rows["torch"].startswith(torch.__version__)
    assert rows["triton"] == triton.__version__
    assert rows["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert rows["torch deterministic algorithms"] == "yes"
    assert rows["Triton interpreter"] == ("no" if torch.cuda.is_available() else "yes")


def test_workbook_parameters_are_python_literals_or_strings():
    args = cli.build_parser().parse_args(
        ["workbook", "-p", "n=3", "-p", "f=0.5", "-p", "name=mamba", "-p", "flag=True", "--only", "01"])
    assert args.parameter == [("n", 3), ("f", 0.5), ("name", "mamba"), ("flag", True)]
    assert args.only == ["01"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["workbook", "-p", "no-equals-sign"])


def _notebook(path: Path, *cells: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell("n = 1")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, *(nbformat.v4.new_code_cell(c) for c in cells)]
    nbformat.write(nb, path)


@pytest.mark.notebook
def test_workbook_builds_pages_and_index_and_names_the_failure(tmp_path):
    src = tmp_path / "notebooks"
    src.mkdir()
    _notebook(src / "00_ok.ipynb", "print('ran with n =', n)")
    _notebook(src / "01_broken.ipynb", "raise RuntimeError('chapter one is broken')")
    _notebook(src / "02_skipped.ipynb", "print('not selected')")
    (src / "notes.ipynb").write_text("not a chapter, never opened")
    out = tmp_path / "build"
    result = run("workbook", "--notebooks", str(src), "--output-dir", str(out), "-p", "n=5",
                 "--only", "00", "--only", "01")
    assert result.returncode == 1
    assert "01_broken.ipynb" in result.stderr and "chapter one is broken" in result.stderr
    assert "00_ok.ipynb" not in result.stderr
    assert "./run.sh lab" in result.stdout
    assert "ran with n = 5" in (out / "notebooks" / "00_ok.ipynb").read_text()
    assert sorted(p.name for p in (out / "html").iterdir()) == ["00_ok.html", "01_broken.html"]
    assert "chapter one is broken" in (out / "html" / "01_broken.html").read_text()
    index = (out / "index.html").read_text()
    assert 'href="html/00_ok.html"' in index and 'href="html/01_broken.html"' in index
    assert "02_skipped" not in index


def _fingerprint_report(capsys, *args):
    assert cli.main(["fingerprint", *args]) == 0
    return capsys.readouterr().out


def test_fingerprint_same_bits_under_every_flag_that_should_not_matter(capsys):
    """--json and text agree; emulating two GPUs changes nothing in deterministic mode; the report names the
    environment. On the CPU, the atomic mode under a simulated program order changes dA and dt_bias's bits."""
    report = json.loads(_fingerprint_report(capsys, "--json", "--emulate", "rtxa6000"))
    fp = report["fingerprint"]
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert report["emulated_profile"] == "rtxa6000" and report["reduction"] == "deterministic"
    assert report["environment"]["versions"]["torch"] == torch.__version__
    assert report["environment"]["sm_count"] == (torch.cuda.get_device_properties(0).multi_processor_count
                                                 if torch.cuda.is_available() else None)   # the real machine's
    assert report["settings"]["torch_deterministic"] and report["settings"]["autotune"] == "pinned"
    assert set(report["parameters"]) >= {"A_log", "dt_bias", "D", "in_proj.weight", "out_proj.weight"}
    assert not torch.are_deterministic_algorithms_enabled()              # the switch was restored
    text = _fingerprint_report(capsys, "--emulate", "l4")
    assert f"gradient fingerprint: {fp}" in text and "NVIDIA L4" in text and "SM count" in text
    if not torch.cuda.is_available():
        atomic = json.loads(_fingerprint_report(capsys, "--json", "--reduction", "atomic", "--simulate-schedule", "3"))
        assert atomic["schedule_simulation_seed"] == 3 and atomic["fingerprint"] != fp
        changed = {k for k, v in atomic["parameters"].items() if v != report["parameters"][k]}
        assert changed & {"A_log", "dt_bias"}, changed
        assert "SIMULATED GPU scheduling" in _fingerprint_report(capsys, "--simulate-schedule", "3")


def test_fingerprint_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fingerprint", "--emulate", "rtx5090"])
    assert "invalid choice" in capsys.readouterr().err
    assert cli.main(["fingerprint", "--seed", "-1"]) == 2
    assert "seed must be a non-negative int" in capsys.readouterr().err


def test_fingerprint_save_twice_compares_identical_and_a_perturbed_element_is_named(capsys, tmp_path):
    a, b, c = (str(tmp_path / name) for name in ("a.pt", "b.pt", "c.pt"))
    for path in (a, b):
        assert cli.main(["fingerprint", "--save", path]) == 0
    capsys.readouterr()
    assert cli.main(["fingerprint", "--compare", a, b]) == 0
    assert capsys.readouterr().out.startswith("identical:")
    saved = torch.load(b, weights_only=True)
    names = list(saved["tensors"])
    assert names[-1] == "output" and all(n.startswith("grad/") for n in names[:-1])
    target = "grad/in_proj.weight"
    assert saved["tensors"][target].dim() == 2
    before = saved["tensors"][target][3, 5].item()
    saved["tensors"][target][3, 5] = before + 1.0   # the first tensors in order stay untouched
    after = saved["tensors"][target][3, 5].item()   # before + 1, rounded to float32
    torch.save(saved, c)
    assert cli.main(["fingerprint", "--compare", a, c]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"different: first difference in {target}, element [3, 5]: {before!r} in {a}, "
                          f"{after!r} in {c}"), out


def test_fingerprint_compare_usage_errors_are_one_line(capsys, tmp_path):
    good = str(tmp_path / "good.pt")
    torch.save({"report": "{}", "tensors": {"x": torch.zeros(2)}}, good)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    for other, message in ((str(tmp_path / "missing.pt"), "missing.pt: no such file"),
                           (str(tmp_path / "junk.pt"), "junk.pt: not a saved fingerprint")):
        assert cli.main(["fingerprint", "--compare", good, other]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mambalab fingerprint: error: ") and message in err[0], err


def test_fingerprint_model_saves_a_library_models_routed_step_that_compares_with_a_rerun(capsys, tmp_path):
    """--model: mamba-ssm's Mamba2 block as users build it, routed onto mambalab's kernels; a second run under an
    emulated RTX A6000 has the same bits, and the report names the model and the routing."""
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    assert cli.main(["fingerprint", "--model", "mamba_ssm.Mamba2", "--save", a]) == 0
    text = capsys.readouterr().out
    assert "mamba_ssm.Mamba2" in text and "mambalab kernels (use_mambalab_kernels)" in text
    assert cli.main(["fingerprint", "--model", "mamba_ssm.Mamba2", "--emulate", "rtxa6000", "--json", "--save", b]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["routed"] is True and report["emulated"] is not None
    assert cli.main(["fingerprint", "--compare", a, b]) == 0


@pytest.mark.parametrize("args, message", [
    (["--no-route"], "--no-route and --size apply to --model only"),
    (["--model", "mamba_ssm.Mamba2", "--reduction", "atomic"], "--reduction and --simulate-schedule apply"),
])
def test_fingerprint_model_flag_misuse_is_one_line(capsys, args, message):
    assert cli.main(["fingerprint", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
