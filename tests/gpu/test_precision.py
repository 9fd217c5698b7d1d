"""``evaluation.precision`` on the GPU: each precision's numbers against fp32's on identical draws
(the same checkpoint, config and seed), with the tolerance docs/guide/cost-and-gpu.md
("Precision") states, and the time per evaluation of each, for the closing note."""

import time

import pytest

PRECISIONS = ("fp32", "tf32", "bf16")


@pytest.fixture(scope="module")
def records(dm, tier, tmp_path_factory):
    d = tmp_path_factory.mktemp("precision")
    out = {}
    for p in PRECISIONS:
        body = (f"icr: {{samples: {tier.n(1024)}, batch_size: 128, seed: 3}}\n"
                f"evaluation: {{precision: {p}}}\n")
        config = dm.config(d / f"{p}.yaml", tier.dev("cuda"), body)
        t0 = time.perf_counter()
        rec, _ = dm.eval_json(config)
        out[p] = (rec, time.perf_counter() - t0)
    return out


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_a_lower_precision_moves_icr_by_less_than_a_quarter_of_its_standard_error(
        records, precision, tier, measure):
    (base, t_base), (low, t_low) = records["fp32"], records[precision]
    assert base["icr_samples"] == low["icr_samples"] == tier.n(1024)
    moved = abs(low["icr"] - base["icr"])
    loss = abs(low["loss_train"] - base["loss_train"]) / base["loss_train"]
    measure(f"{precision}: icr {low['icr']:.6f} against fp32 {base['icr']:.6f}: "
            f"{moved / base['icr_stderr']:.3f} standard errors (bar 0.25); loss_train rel "
            f"{loss:.2e} (tol 1e-2); {t_low:.1f} s against fp32 {t_base:.1f} s per eval call")
    # The bar for a precision (docs/design.md §11, "Precision"): a quarter of ICR's jackknife
    # standard error. The untrained tier UNet is not the trained network the bar is about, but a
    # precision that misses it even here is worse than documented.
    assert moved < 0.25 * base["icr_stderr"]
    # A mean of squared errors over the loss images: rounding in bfloat16 (2^-8 relative per
    # product) averages out to well under a percent.
    assert loss < 1e-2


def test_tf32_is_fp32_where_tf32_does_not_exist(records, tier):
    if not tier.dry_run:
        pytest.skip("on a GPU, TF32 changes the products: measured above, not equal")
    assert records["tf32"][0]["icr"] == records["fp32"][0]["icr"]
