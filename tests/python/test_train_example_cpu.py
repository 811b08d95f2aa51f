"""examples/train_qwen3_moe.py's loss comparison without a GPU: the final-loss reading averages the
last 10% of the steps (at most 20), because one step's loss is one batch's; the bf16 noise floor
(hf_reordered) gets the same figures; synthetic curves with known differences."""
import importlib.util
import os

import pytest

pytest.importorskip("torch")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_qwen3_moe.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_qwen3_moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(losses, step_ms=100.0):
    return {"losses": list(losses), "median_step_ms": step_ms, "peak_memory_gib": 1.0}


@pytest.mark.parametrize("steps, window", [(200, 20), (300, 20), (50, 5), (9, 1), (1, 1)])
def test_final_window_is_a_tenth_of_the_steps_at_most_20(example, steps, window):
    assert example.final_window(steps) == window


def test_window_mean_differs_from_the_last_step(example):
    steps = 200
    hf = [2.0 - i / steps for i in range(steps)]
    # fusemoe 1% above hf over the last 20 steps except on the very last, where it is 5% below.
    fm = hf[:180] + [1.01 * v for v in hf[180:199]] + [0.95 * hf[199]]
    reordered = [v * 0.98 for v in hf]
    c = example.compare({"hf": run(hf, 300.0), "fusemoe": run(fm, 200.0), "hf_reordered": run(reordered)})
    assert c["final_window_steps"] == 20
    assert c["final_loss_rel_diff"] == pytest.approx(-0.05)
    want = (sum(fm[180:]) - sum(hf[180:])) / sum(hf[180:])
    assert c["final_window_rel_diff"] == pytest.approx(want)
    assert 0.004 < c["final_window_rel_diff"] < 0.01
    assert c["noise_final_window_steps"] == 20
    assert c["noise_final_loss_rel_diff"] == pytest.approx(-0.02)
    assert c["noise_final_window_rel_diff"] == pytest.approx(-0.02)
    assert c["speedup_step_time"] == pytest.approx(1.5)


def test_no_noise_figures_without_the_reordered_run(example):
    c = example.compare({"hf": run([3.0, 2.0, 1.0]), "fusemoe": run([3.0, 2.0, 1.1])})
    assert c["final_window_steps"] == 1
    assert c["final_window_rel_diff"] == pytest.approx(0.1)
    assert not any(key.startswith("noise_") for key in c)


def test_fp8_weight_grads_flag_needs_fp8(example, capsys):
    """--fp8-weight-grads is FP8's option (fusemoe.MoEExperts fp8_weight_grads): accepted with
    --precision fp8, refused with a usage error naming it otherwise."""
    args = example.parse_args(["--precision", "fp8", "--fp8-weight-grads"])
    assert args.fp8_weight_grads and args.precision == "fp8"
    assert not example.parse_args([]).fp8_weight_grads
    with pytest.raises(SystemExit):
        example.parse_args(["--fp8-weight-grads"])
    assert "--fp8-weight-grads needs --precision fp8" in capsys.readouterr().err
