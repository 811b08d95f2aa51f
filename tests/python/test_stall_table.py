"""scripts/stall_table.py on a made-up Nsight Compute source-page CSV (the real one comes from
scripts/profile_stalls.sh on the H200): the ranking, the opcode totals and the refusal of a CSV
without stall samples. No GPU, no torch."""
import csv
import io
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "stall_table.py")


def source_csv(path, with_stalls=True):
    header = ["Address", "Source", "Instructions Executed"]
    if with_stalls:
        header += ["Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)"]
    rows = [
        ["0x00", "MOV R1, c[0x0][0x28] ;", "1", "10", "5"],
        ["0x10", "@P0 HGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ ;", "64", "1,200", "900"],
        ["0x20", "FFMA R3, R4, R5, R3 ;", "512", "600", "100"],
        ["0x30", "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", "64", "2,190", "2,000"],
    ]
    buf = io.StringIO()
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL)
    writer.writerow(["Kernel Name: GateUp..."])  # ncu puts lines before the header
    writer.writerow(header)
    for row in rows:
        writer.writerow(row if with_stalls else row[:3])
    path.write_text(buf.getvalue())


def run(path):
    return subprocess.run([sys.executable, SCRIPT, str(path), "--top", "3"], capture_output=True, text=True)


def test_ranks_lines_and_opcodes(tmp_path):
    path = tmp_path / "source.csv"
    source_csv(path)
    result = run(path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "4 SASS lines, 4000 stall samples"
    top = [l for l in lines if l.startswith("  ") and "#" in l]
    assert len(top) == 3
    assert "WARPGROUP.DEPBAR" in top[0] and "54.8%" in top[0]  # 2190 of 4000
    assert "HGMMA" in top[1] and "30.0%" in top[1]
    assert "FFMA" in top[2]
    opcodes = lines[lines.index("by opcode:") + 1:]
    assert opcodes[0].split() == ["54.8%", "WARPGROUP"]
    assert opcodes[1].split() == ["30.0%", "HGMMA"]  # the predicate @P0 is not the opcode


def test_csv_without_stall_samples_is_refused(tmp_path):
    path = tmp_path / "source.csv"
    source_csv(path, with_stalls=False)
    result = run(path)
    assert result.returncode == 2
    assert "SourceCounters" in result.stderr
