#!/usr/bin/env python3
"""What bounds each kernel of the fused layer, from Nsight Compute metrics over fusemoe_bench
(scripts/profile_bounds.sh writes the input: the bench's own output and ncu's --csv rows in one
file per case). For the first forward and the first backward with bf16 weight gradients of the
run: each GEMM and pool kernel's time, tensor-pipe / DRAM / L2 throughput in % of peak, SM clock,
and a reading of what bounds it; for the forward GEMMs also the DRAM bytes read over the bytes
of their operands (gate/up: w13 + the routed x rows; down: w2 + the h pool; one byte an element and
the block scales for FP8 instances), which shows weight slices read from HBM more than once.

Usage: python3 scripts/bound_table.py CASE_FILE [CASE_FILE ...]  (prints Markdown)
Exit 2 when a file holds no ncu rows or no forward (wrong kernel filter or metrics)."""
import argparse
import collections
import csv
import re
import sys

TIME = "gpu__time_duration.sum"
TENSOR = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed"
DRAM = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
L2 = "lts__throughput.avg.pct_of_peak_sustained_elapsed"
DRAM_READ = "dram__bytes_read.sum"
CLOCK = "sm__cycles_elapsed.avg.per_second"
METRICS = (TIME, TENSOR, DRAM, L2, DRAM_READ, CLOCK)

# "layer qwen3-30b-a3b: H=2048 I=768 E=128 K=8; tokens 4096; routing uniform; ..."
LAYER_LINE = re.compile(r"layer (\S+): H=(\d+) I=(\d+) E=(\d+) K=(\d+); tokens (\d+); routing ([^;\s]+)")
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
CLOCK_UNITS = {"hz": 1e-9, "Khz": 1e-6, "Mhz": 1e-3, "Ghz": 1.0, "cycle/second": 1e-9, "cycle/nsecond": 1.0}


def role(name):
    """The kernel's part of the layer, from its demangled name; None for the harness's own kernels."""
    # By the epilogue: the row gather (GatheredTokenRowsA) is the gate/up's and, since e6af4a4,
    # also FP8 dgrad-1's and the FP8 z recompute's.
    if "WeightGradEpilogue<0, 0>" in name:
        return "dW bf16"
    if "WeightGradEpilogue<1" in name or "WeightGradEpilogue<0, 1>" in name:
        return "dW other"
    if "DgradSwiGLU" in name:
        return "dgrad-1"
    if "RowStoreEpilogue<256, 1" in name:
        return "down"
    if "RowStoreEpilogue<256, 0, 0>" in name:  # sorted rows: the z recompute
        return "z recompute"
    if "RowStoreEpilogue<256, 0" in name:
        return "dgrad-2"
    if "GatheredTokenRowsA" in name:
        return "gate/up"
    # scatter_token_rows: the token-major x and dy pools; FP8's x quantization (forward,
    # quantize_token_rows_fp8 since 0cf4413) and its dy quantization with the bf16 pools (backward,
    # quantize_pool_rows_fp8; both were quantize_rows_fp8 before). Weight quantization is once per
    # weight version, not part of a pass.
    for key, label in (("routing_count", "routing"), ("routing_place", "routing"), ("gather_rows", "x, dy pools"),
                       ("scatter_token_rows", "x, dy pools"), ("quantize_rows_fp8", "FP8 quantize"),
                       ("quantize_token_rows_fp8", "FP8 quantize"), ("quantize_pool_rows_fp8", "FP8 quantize"),
                       # LayerConfig::fp8_weight_grads: the weight gradients' transposed operands
                       ("quantize_token_blocked", "FP8 token blocks"), ("token_block_offsets", "FP8 token blocks"),
                       ("combine", "combine"), ("router", "router")):
        if key in name:
            return label
    return None


def load(path):
    """(layer dict or None, [kernel dicts in launch order]) from one case file."""
    layer = None
    csv_lines = []
    with open(path) as f:
        for line in f:
            if line.startswith('"'):
                csv_lines.append(line)
            elif layer is None:
                m = LAYER_LINE.search(line)
                if m:
                    layer = dict(preset=m.group(1), H=int(m.group(2)), I=int(m.group(3)), E=int(m.group(4)),
                                 K=int(m.group(5)), T=int(m.group(6)), routing=m.group(7))
    kernels = collections.OrderedDict()
    reader = csv.reader(csv_lines)
    header = next(reader, None)
    if header is None:
        return layer, []
    for row in reader:
        cells = dict(zip(header, row))
        if "ID" not in cells or "Metric Name" not in cells:
            continue
        k = kernels.setdefault(int(cells["ID"]), {"name": cells.get("Kernel Name", "")})
        value = float(cells["Metric Value"].replace(",", "") or "nan")
        unit = cells.get("Metric Unit", "")
        metric = cells["Metric Name"]
        if metric == TIME:
            value *= TIME_UNITS.get(unit, float("nan"))
        elif metric == DRAM_READ:
            value *= BYTE_UNITS.get(unit, float("nan"))
        elif metric == CLOCK:
            value *= CLOCK_UNITS.get(unit, float("nan"))
        k[metric] = value
    out = []
    for k in kernels.values():
        k["role"] = role(k["name"])
        if k["role"] is not None:
            out.append(k)
    return layer, out


def passes(kernels):
    """{'forward': [...], 'backward': [...]}: the first forward (routing and FP8's x quantization
    through combine around the first gate/up) and the first backward with bf16 weight gradients (the
    routing before its first dW bf16 through its last)."""
    roles = [k["role"] for k in kernels]
    out = {}
    if "gate/up" in roles:
        g = roles.index("gate/up")
        start = g
        while start > 0 and roles[start - 1] in ("routing", "FP8 quantize"):
            start -= 1
        end = g
        while end + 1 < len(roles) and roles[end + 1] in ("down", "combine"):
            end += 1
            if roles[end] == "combine":
                break
        out["forward"] = kernels[start:end + 1]
    if "dW bf16" in roles:
        first = roles.index("dW bf16")
        start = max((i for i in range(first) if roles[i] == "routing"), default=0)
        while start > 0 and roles[start - 1] == "routing":
            start -= 1
        end = first
        while end + 1 < len(roles) and roles[end + 1] == "dW bf16":
            end += 1
        out["backward"] = kernels[start:end + 1]
    return out


def bound(k):
    """What holds the kernel, read from its throughputs: tensor pipe >= 85%, DRAM >= 80%, L2 >= 85%
    (this project's thresholds), in that order; below all three, latency (or several partly)."""
    if k.get(TENSOR, 0) >= 85:
        return "tensor pipe"
    if k.get(DRAM, 0) >= 80:
        return "DRAM"
    if k.get(L2, 0) >= 85:
        return "L2"
    return "none near its peak (latency)"


def operand_bytes(layer, which, fp8=False):
    """Bytes of a forward GEMM's operands at uniform routing with no masked slot (an upper bound
    on the rows: masked slots route no row). FP8: E4M3 elements, an fp32 scale per 128 x 128
    weight block and per 128 row elements."""
    H, I, E, K, T = layer["H"], layer["I"], layer["E"], layer["K"], layer["T"]
    weights, rows = (E * 2 * I * H, T * K * H) if which == "gate/up" else (E * H * I, T * K * I)
    if fp8:
        return weights + weights * 4 // (128 * 128) + rows + rows * 4 // 128
    return weights * 2 + rows * 2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    lines = ["| case | pass: kernel sum | kernel: µs, tensor / DRAM / L2 %, SM GHz: bound |", "| --- | --- | --- |"]
    reads = []
    for path in args.files:
        layer, kernels = load(path)
        found = passes(kernels)
        if not kernels or "forward" not in found:
            print(f"{path}: no ncu kernel rows with a forward (kernel filter or metrics wrong)", file=sys.stderr)
            return 2
        case = path if layer is None else f"{layer['preset']} T={layer['T']}" + (
            f" {layer['routing']}" if layer["routing"] != "uniform" else "")
        for name, ks in found.items():
            total = sum(k.get(TIME, 0.0) for k in ks)
            dw = 0
            parts = []
            for k in ks:
                label = k["role"]
                if label in ("routing", "combine", "router"):
                    continue
                if label == "dW bf16":
                    label = "dW2" if dw == 0 else "dW13"
                    dw += 1
                parts.append(f"{label} {k.get(TIME, 0):.0f}, {k.get(TENSOR, 0):.0f} / {k.get(DRAM, 0):.0f} / "
                             f"{k.get(L2, 0):.0f}, {k.get(CLOCK, 0):.2f}: {bound(k)}")
                if name == "forward" and layer is not None and label in ("gate/up", "down"):
                    reads.append((case, label, k.get(DRAM_READ, 0.0), operand_bytes(layer, label, "Fp8" in k["name"])))
            lines.append(f"| {case} | {name}: {total:.0f} µs | {'; '.join(parts)} |")
    print("\n".join(lines))
    if reads:
        print("\n| case | forward GEMM | DRAM read GB | operand GB | read / operands |\n| --- | --- | ---: | ---: | ---: |")
        for case, label, read, need in reads:
            print(f"| {case} | {label} | {read / 1e9:.2f} | {need / 1e9:.2f} | {read / need:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
