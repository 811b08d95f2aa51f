#!/usr/bin/env python3
"""The SASS lines of one kernel that hold the most warp-stall samples, and the samples per
opcode, from Nsight Compute's source page exported as CSV
(`ncu --import R.ncu-rep --page source --csv --print-source sass`; scripts/profile_stalls.sh).

Usage: python3 scripts/stall_table.py SOURCE_CSV [--top N]
Exit 2 when the CSV has no stall-sampling column (the collection lacked SourceCounters)."""
import argparse
import csv
import re
import sys

STALL_COLUMN = re.compile(r"Warp Stall Sampling \(All")
NOT_ISSUED_COLUMN = re.compile(r"Warp Stall Sampling \(Not")
SOURCE_COLUMN = re.compile(r"^Source$")


def number(cell):
    cell = (cell or "").replace(",", "").strip()
    try:
        return float(cell)
    except ValueError:
        return 0.0


def find_header(rows):
    """Index of the header row and the columns (source, all samples, not-issued samples or None)."""
    for i, row in enumerate(rows):
        source = next((j for j, c in enumerate(row) if SOURCE_COLUMN.match(c.strip())), None)
        stall = next((j for j, c in enumerate(row) if STALL_COLUMN.search(c)), None)
        if source is not None and stall is not None:
            not_issued = next((j for j, c in enumerate(row) if NOT_ISSUED_COLUMN.search(c)), None)
            return i, source, stall, not_issued
    return None


def opcode(sass):
    """The instruction's opcode without predicate and modifiers: '@!P0 HGMMA.64x128x32.F32' -> HGMMA."""
    tokens = sass.strip().split()
    if tokens and tokens[0].startswith("@"):
        tokens = tokens[1:]
    return tokens[0].split(".")[0].rstrip(";") if tokens else "?"


def table(rows, top):
    found = find_header(rows)
    if found is None:
        return None
    header_at, source, stall, not_issued = found
    lines = []
    for row in rows[header_at + 1:]:
        if len(row) <= max(source, stall):
            continue
        lines.append((row[source].strip(), number(row[stall]),
                      number(row[not_issued]) if not_issued is not None and len(row) > not_issued else 0.0))
    total = sum(s for _, s, _ in lines)
    out = [f"{len(lines)} SASS lines, {total:.0f} stall samples"]
    if total <= 0:
        return out
    out.append(f"top {top} lines by samples (% of all, not-issued samples):")
    ranked = sorted(enumerate(lines), key=lambda item: -item[1][1])[:top]
    for index, (sass, samples, idle) in ranked:
        out.append(f"  {100 * samples / total:5.1f}%  {idle:8.0f}  #{index:<5d} {sass[:100]}")
    by_opcode = {}
    for sass, samples, _ in lines:
        by_opcode[opcode(sass)] = by_opcode.get(opcode(sass), 0.0) + samples
    out.append("by opcode:")
    for name, samples in sorted(by_opcode.items(), key=lambda kv: -kv[1])[:15]:
        out.append(f"  {100 * samples / total:5.1f}%  {name}")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source_csv")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.source_csv, newline="") as f:
        rows = list(csv.reader(f))
    out = table(rows, args.top)
    if out is None:
        print(f"stall_table: no 'Source' and 'Warp Stall Sampling (All Samples)' columns in "
              f"{args.source_csv} (collect with --section SourceCounters)", file=sys.stderr)
        return 2
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
