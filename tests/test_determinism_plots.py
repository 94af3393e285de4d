"""The determinism chapters' helpers: mambalab.determinism's experiment modules (float sums in an order, the atomic-add
demo kernel and its landing order, gradient variation tables, mamba-ssm's SM-count split, fingerprint
matrices, two-machine training) and mambalab.viz.determinism_plots (figures, tables, the sum-order explorer).

On the CPU, run-to-run variation exists only under the seeded program-order simulation
(mambalab.determinism.shuffled_program_order); sizes are tiny so the file stays fast."""
import pytest
import torch

from mambalab import determinism as ex
from mambalab.viz import determinism_plots as dp

from conftest import KERNEL_DEVICE, requires_gpu

ON_CPU = KERNEL_DEVICE == "cpu"
requires_interpreter = pytest.mark.skipif(not ON_CPU, reason="the program-order simulation is CPU-only")


# ------------------------------------------------------------------------------------------- float sums
def test_float_bits_spells_sign_exponent_mantissa():
    assert ex.float_bits(1.0) == "0 01111111 " + "0" * 23
    assert ex.float_bits(-2.0, torch.bfloat16) == "1 10000000 0000000"
    assert ex.float_bits(0.5, torch.float16) == "0 01110 0000000000"
    with pytest.raises(ValueError, match="dtype must be one of"):
        ex.float_bits(1.0, torch.int32)


def test_ordered_sum_depends_on_the_order():
    v = [1e8, 1.0, -1e8]
    assert float(ex.ordered_sum(v, [0, 1, 2])) == 0.0      # 1e8 + 1 rounds back to 1e8 in fp32
    assert float(ex.ordered_sum(v, [0, 2, 1])) == 1.0
    assert float(ex.ordered_sum(v, [0, 1, 2], torch.float64)) == 1.0
    with pytest.raises(ValueError, match="order must be a permutation of range"):
        ex.ordered_sum(v, [0, 0, 1])


def test_order_spread_counts_every_order():
    x = torch.randn(32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    spread = ex.order_spread(x, 60, seed=1)
    assert sum(spread.values()) == 60 and len(spread) > 1
    assert ex.order_spread([1.0, 2.0, 3.0, 4.0], 20) == {10.0: 20}   # small integers: exact in any order


# ------------------------------------------------------------------------------------------- the atomic-add kernel
def test_atomic_sum_is_its_partials_folded_in_landing_order(kernel_device):
    x = torch.randn(40, generator=torch.Generator().manual_seed(0)).to(kernel_device)
    run = ex.atomic_sum(x, block=4)
    assert sorted(run.order) == list(range(10))
    assert ex.fold_in_order(run.partials, run.order).view(torch.int32) == run.total.view(torch.int32)
    torch.testing.assert_close(run.partials, x.cpu().view(10, 4).sum(1), rtol=1e-6, atol=1e-6)
    if ON_CPU:
        assert run.order == list(range(10))   # the interpreter runs programs in launch order


@requires_interpreter
def test_atomic_sum_landing_order_follows_the_simulated_schedule():
    from mambalab.determinism import shuffled_program_order

    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    runs = []
    for seed in range(4):
        with shuffled_program_order(seed):
            runs.append(ex.atomic_sum(x, block=4))
    assert len({tuple(r.order) for r in runs}) == 4
    for r in runs:
        assert ex.fold_in_order(r.partials, r.order).view(torch.int32) == r.total.view(torch.int32)


def test_atomic_sum_rejects_bad_input():
    with pytest.raises(ValueError, match="x must be a non-empty 1-d fp32 tensor"):
        ex.atomic_sum(torch.ones(2, 2))
    with pytest.raises(ValueError, match="block must be a positive power of two"):
        ex.atomic_sum(torch.ones(8), block=3)


# ------------------------------------------------------------------------------------------- tables of variation
def test_gradient_variation_counts_patterns_and_differences():
    def step(run):
        return {"same": torch.ones(3), "varies": torch.tensor([1.0, 2.0 + 0.5 * (run % 2)])}

    rows = {r.name: r for r in ex.gradient_variation(step, 4)}
    assert (rows["same"].distinct, rows["same"].max_abs_diff) == (1, 0.0)
    assert (rows["varies"].distinct, rows["varies"].max_abs_diff) == (2, 0.5)
    assert rows["varies"].max_rel_diff == pytest.approx(0.25)
    with pytest.raises(ValueError, match="runs must be at least 2"):
        ex.gradient_variation(step, 1)


@requires_interpreter
def test_variation_in_subprocess_runs_a_fresh_process_and_reports_its_errors():
    got = ex.variation_in_subprocess({"MAMBA_DETERMINISTIC": "1"}, impl="mambalab", shape=(1, 16, 2, 4, 1, 4),
                                     chunk_size=16, runs=2, device="cpu")
    assert got == {k: 1 for k in ex.SSD_GRAD_NAMES}   # no simulation in the child: launch order, one pattern
    with pytest.raises(RuntimeError, match="the subprocess failed"):
        ex.variation_in_subprocess({}, impl="mambalab", shape=(1, 16, 3, 4, 2, 4), chunk_size=16, runs=2,
                                   device="cpu")   # g = 2 does not divide h = 3


def test_mamba_ssm_head_split_reads_the_sm_count():
    # the benchmark's shape: b=4, c=16 chunks, h=32, g=1 -> b*c*h = 2048 head-chunks
    assert ex.mamba_ssm_head_split(4, 16, 32, 1, 132) == (16, 2)    # H200
    assert ex.mamba_ssm_head_split(4, 16, 32, 1, 128) == (16, 2)    # RTX 4090: same grouping
    assert ex.mamba_ssm_head_split(4, 16, 32, 1, 84) == (25, 2)     # RTX A6000: 25 + 7 instead of 16 + 16
    assert ex.mamba_ssm_head_split(4, 16, 32, 1, 58) == (32, 1)     # L4: capped at h / g
    assert ex.mamba_ssm_head_split(1, 1, 8, 2, 132) == (1, 4)
    with pytest.raises(ValueError, match="g = 3 must divide h = 8"):
        ex.mamba_ssm_head_split(1, 1, 8, 3, 132)
    with pytest.raises(ValueError, match="sm_count must be a positive int"):
        ex.mamba_ssm_head_split(1, 1, 8, 1, 0)


def test_mamba_ssm_norm_split_follows_the_sm_count():
    # gated, one group of 1024 channels: next_pow2(1024) / 256 = 4 warps, so ceil(4 / 4) = 1 block per SM
    assert ex.mamba_ssm_norm_split(256, 1024, 128) == (128, 2)
    assert ex.mamba_ssm_norm_split(256, 1024, 84) == (84, 4)
    # 64 channels: 1 warp, four blocks per SM (mamba-ssm's occupancy rule), shared by the groups
    assert ex.mamba_ssm_norm_split(4096, 256, 128, group_size=64) == (128, 32)
    assert ex.mamba_ssm_norm_split(256, 1024, 84, kind="plain") == (84, 4)
    with pytest.raises(ValueError, match="group_size must be a positive divisor"):
        ex.mamba_ssm_norm_split(256, 1024, 84, group_size=100)
    with pytest.raises(ValueError, match="kind must be one of"):
        ex.mamba_ssm_norm_split(256, 1024, 84, kind="layer")


@requires_interpreter
def test_norm_weight_gradient_follows_the_emulated_sm_count_in_mamba_ssm_only():
    from mambalab.determinism import emulate, fingerprint

    inputs = ex.norm_inputs(128, 1024, seed=3)
    prints = {}
    for impl in ("mamba_ssm", "mambalab"):
        for profile in ("rtx4090", "rtxa6000"):   # 128 programs of 1 row; 84 of 2 rows (64 hold rows)
            with emulate(profile):
                grads = ex.norm_gradients(inputs, impl=impl, kind="gated")
            prints[impl, profile] = {k: fingerprint(v) for k, v in grads.items()}
    assert prints["mamba_ssm", "rtx4090"]["x"] == prints["mamba_ssm", "rtxa6000"]["x"]
    assert prints["mamba_ssm", "rtx4090"]["weight"] != prints["mamba_ssm", "rtxa6000"]["weight"]
    assert prints["mambalab", "rtx4090"] == prints["mambalab", "rtxa6000"]
    # both compute the same gradient, to fp32 rounding, against a float64 autograd reference
    x = inputs["x"].double().requires_grad_()
    w = inputs["weight"].double().requires_grad_()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * w * torch.nn.functional.silu(inputs["z"].double())
    y.backward(inputs["dout"].double())
    with emulate("rtx4090"):
        ours = ex.norm_gradients(inputs, impl="mamba_ssm", kind="gated")
    torch.testing.assert_close(ours["weight"].double(), w.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ex.norm_gradients(inputs, impl="mambalab")["weight"].double(), w.grad,
                               rtol=1e-4, atol=1e-4)


def test_norm_gradients_rejects_bad_arguments():
    inputs = ex.norm_inputs(4, 8)
    with pytest.raises(ValueError, match="impl must be"):
        ex.norm_gradients(inputs, impl="apex")
    with pytest.raises(ValueError, match="kind must be one of"):
        ex.norm_gradients(inputs, kind="layer")


def test_source_excerpt_shows_the_lines_between_two_markers():
    from mambalab.kernels.ssd import chunk_cumsum

    src = dp.source_excerpt(chunk_cumsum.chunk_cumsum_bwd_kernel, "if REDUCE_ATOMIC", "tl.store(dbias_ptr")
    lines = src.code.splitlines()
    assert lines[0] == "if REDUCE_ATOMIC:" and "tl.store(dbias_ptr" in lines[-1]
    assert "tl.atomic_add(dA_ptr" in src.code
    first, last = map(int, src.caption.rsplit(":", 1)[1].rstrip(")").split("-"))
    assert last - first + 1 == len(lines)
    with open(chunk_cumsum.__file__) as f:
        assert f.read().splitlines()[first - 1].strip() == "if REDUCE_ATOMIC:"
    with pytest.raises(ValueError, match="contains 'no such line'"):
        dp.source_excerpt(chunk_cumsum.chunk_cumsum_bwd_kernel, "no such line")


@requires_interpreter
def test_fingerprint_matrix_deterministic_is_one_value_atomic_is_not():
    row0 = ex.ssd_inputs(1, 32, 2, 4, 1, 4)
    kw = dict(profiles=("rtx4090", "rtxa6000"), batch_sizes=(3,), runs=2, simulate=True)
    det = ex.fingerprint_matrix(row0, 16, reduction="deterministic", **kw)
    assert len(det) == 4 and len({r["row0"] for r in det}) == 1 and len({r["summed"] for r in det}) == 1
    atomic = ex.fingerprint_matrix(row0, 16, reduction="atomic", **kw)
    assert len({r["summed"] for r in atomic}) > 1


def test_batch_with_row0_keeps_row0_and_per_head_tensors():
    row0 = ex.ssd_inputs(1, 16, 2, 4, 1, 4)
    batch = ex.batch_with_row0(row0, 3, seed=5)
    assert batch["x"].shape == (3, 16, 2, 4) and torch.equal(batch["x"][:1], row0["x"])
    assert torch.equal(batch["A"], row0["A"]) and not torch.equal(batch["x"][1], batch["x"][2])


# ------------------------------------------------------------------------------------------- two machines train
@requires_interpreter
def test_two_emulated_machines_agree_only_in_deterministic_mode():
    kw = dict(batch=2, seqlen=32, d_in=4, d_model=8, d_state=4, headdim=4, chunk_size=16)
    det = [ex.train_losses(1, reduction="deterministic", profile=p, schedule_seed=s, **kw)
           for p, s in (("rtx4090", 1), ("rtxa6000", 2))]
    assert det[0].fingerprints == det[1].fingerprints and det[0].losses == det[1].losses
    atomic = [ex.train_losses(1, reduction="atomic", profile=p, schedule_seed=s, **kw)
              for p, s in (("rtx4090", 1), ("rtxa6000", 2))]
    assert atomic[0].first_divergence(atomic[1]) == 0
    assert det[0].first_divergence(det[1]) is None


def test_train_losses_rejects_a_simulation_off_the_cpu():
    with pytest.raises(ValueError, match="schedule_seed simulates"):
        ex.train_losses(1, schedule_seed=1, device="cuda")
    with pytest.raises(ValueError, match="impl must be"):
        ex.train_losses(1, impl="other")


# ------------------------------------------------------------------------------------------- figures and tables
def test_table_renders_html_and_text_and_checks_rows():
    t = dp.table(["a", "b"], [[1, 0.000123456], ["x<y", 0.0]], "caption")
    assert "<caption" in t._repr_html_() and "x&lt;y" in t._repr_html_()
    text = repr(t).splitlines()
    assert text[0] == "caption" and text[1].split() == ["a", "b"] and text[3].split() == ["1", "0.000123"]
    assert text[4].split() == ["x<y", "0"]
    with pytest.raises(ValueError, match="do not have 2 cells"):
        dp.table(["a", "b"], [[1]])


def test_bits_html_counts_differing_bits():
    page = dp.bits_html(1.0, 1.0 + 2 ** -23, torch.float32)
    assert "1 bit(s) differ" in page
    assert "0 bit(s) differ" in dp.bits_html(2.0, 2.0)


def test_sum_order_figure_has_one_line_per_order_and_labels():
    fig = dp.sum_order_figure([1e8, 1.0, -1e8], {"as given": [0, 1, 2], "other": [0, 2, 1]})
    assert len(fig.data) == 2 and "sum = 0.0" in fig.data[0].name and "sum = 1.0" in fig.data[1].name
    assert fig.layout.title.text and fig.layout.xaxis.title.text and fig.layout.yaxis.title.text


def test_landing_order_figure_labels_the_simulation():
    run = ex.AtomicSumRun(torch.tensor(1.5), torch.tensor([1.0, 0.5]), [1, 0])
    fig = dp.landing_order_figure({"r": run}, simulated=True)
    assert "SIMULATED" in fig.layout.title.text and list(fig.data[0].z[0]) == [1, 0]
    assert "SIMULATED" not in dp.landing_order_figure({"r": run}, simulated=False).layout.title.text
    with pytest.raises(ValueError, match="at least one"):
        dp.landing_order_figure({}, simulated=True)


def test_loss_curves_figure_says_which_pairs_are_bitwise_equal():
    curves = {"a1": [1.0, 0.5], "a2": [1.0, 0.5], "b1": [1.0, 0.5], "b2": [1.0, 0.5000001]}
    fig = dp.loss_curves_figure(curves, {"det": ("a1", "a2"), "atomic": ("b1", "b2")}, "t")
    names = [t.name for t in fig.data]
    assert "det: bitwise equal at all 2 steps" in names and "atomic: differ at 1 of 2 steps" in names
    with pytest.raises(ValueError, match="names curve 'zz'"):
        dp.loss_curves_figure(curves, {"p": ("a1", "zz")}, "t")


def test_cost_figure_labels_ratios():
    fig = dp.cost_figure({"base": 2.0, "det": 3.0}, "base", "t")
    assert list(fig.data[0].text) == ["2 ms (1.00×)", "3 ms (1.50×)"]
    with pytest.raises(ValueError, match="baseline 'x'"):
        dp.cost_figure({"base": 2.0}, "x", "t")


def test_sum_order_explorer_starts_at_its_defaults():
    controls = dp.sum_order_explorer([1e8, 1.0, -1e8, 3.0], seed=2, dtype="bf16")
    assert controls["seed"].value == 2 and controls["dtype"].value == "bf16"


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@requires_gpu
def test_gpu_atomic_sum_recovers_the_hardware_order():
    x = torch.randn(1 << 16, device="cuda")
    for _ in range(3):
        run = ex.atomic_sum(x, block=256)
        assert ex.fold_in_order(run.partials, run.order).view(torch.int32) == run.total.view(torch.int32)


@pytest.mark.gpu
@requires_gpu
def test_gpu_deterministic_fingerprints_are_one_value():
    row0 = ex.ssd_inputs(1, 512, 8, 64, 1, 64, dtype=torch.bfloat16, device="cuda")
    rows = ex.fingerprint_matrix(row0, 128, profiles=("rtx4090", "rtxa6000", "l4"), batch_sizes=(1, 4), runs=3,
                                 reduction="deterministic", simulate=False)
    assert len({r["row0"] for r in rows}) == 1
    assert all(len({r["summed"] for r in rows if r["batch"] == b}) == 1 for b in (1, 4))


def test_split_groupings_figure_colours_each_grouping_once():
    fig = dp.split_groupings_figure(4, 4096, 32, 1, 256)
    bars = [t for t in fig.data if t.type == "bar"]
    # 132 and 128 SMs group alike; 84, 82 (25 heads), 108 (19) and 58 (capped at 32) each otherwise
    assert sum(len(t.x) for t in bars) == 7
    assert sorted(t.y[0] for t in bars) == sorted({ex.mamba_ssm_head_split(4, 16, 32, 1, sm)[0]
                                                    for sm in (128, 84, 82, 108, 132, 58)})
    assert f"mamba-ssm {len(bars)} distinct" in fig.layout.title.text
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text
