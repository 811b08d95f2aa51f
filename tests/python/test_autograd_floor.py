"""benchmarks/autograd_floor.py on the CPU (--device cpu): it runs, prints its six rows and writes
them to --json as positive finite host times; an impossible argument is refused by name."""
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "benchmarks", "autograd_floor.py")


def test_rows_on_cpu(tmp_path):
    out = tmp_path / "floor.json"
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--calls", "4", "--repeats", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    expected = [f"{op}: {row}" for op in ("empty", "pass")
                for row in ("forward with autograd", "backward() of a kept graph",
                            "backward per layer, 8 layers per backward()")]
    assert sorted(rows) == sorted(expected)
    for label, us in rows.items():
        assert math.isfinite(us) and us > 0, label
        assert label in run.stdout


def test_refuses_zero_calls():
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--calls", "0"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "--calls" in run.stderr
