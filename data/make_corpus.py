#!/usr/bin/env python3
"""Builds data/corpus.txt, the byte-level training text of examples/train_qwen3_moe.py.

Contents, in this order, each file under a "==> name <==" line:
  1. The FSF licence texts shipped by Debian in /usr/share/common-licenses (GPL-1, GPL-2, GPL-3,
     LGPL-2, LGPL-2.1, LGPL-3, GFDL-1.2, GFDL-1.3). Each says "Everyone is permitted to copy and
     distribute verbatim copies of this license document, but changing it is not allowed": they
     are included verbatim.
  2. This repository's own documentation and sources as committed at HEAD (git ls-files; text
     files by extension; data/ excluded).
usage: python3 data/make_corpus.py [--out data/corpus.txt]   (run from anywhere in the repo)
"""
import argparse
import os
import subprocess
import sys

LICENSES_DIR = "/usr/share/common-licenses"
LICENSES = ["GPL-1", "GPL-2", "GPL-3", "LGPL-2", "LGPL-2.1", "LGPL-3", "GFDL-1.2", "GFDL-1.3"]
SOURCE_SUFFIXES = (".md", ".h", ".cuh", ".cpp", ".cu", ".py", ".sh", ".txt", ".toml")
MAX_BYTES = 2 << 20  # keep the repository light


def main():
    repo = subprocess.check_output(["git", "rev-parse", "--show-toplevel"],
                                   cwd=os.path.dirname(os.path.abspath(__file__)), text=True).strip()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(repo, "data", "corpus.txt"))
    args = parser.parse_args()

    parts = []
    for name in LICENSES:
        with open(os.path.join(LICENSES_DIR, name), "rb") as f:
            parts.append((f"common-licenses/{name}", f.read()))
    files = subprocess.check_output(["git", "ls-files"], cwd=repo, text=True).split()
    for path in sorted(files):
        if path.startswith("data/") or not path.endswith(SOURCE_SUFFIXES):
            continue
        parts.append((path, subprocess.check_output(["git", "show", f"HEAD:{path}"], cwd=repo)))

    corpus = b"".join(f"==> {name} <==\n".encode() + text.rstrip(b"\n") + b"\n\n"
                      for name, text in parts)
    if len(corpus) > MAX_BYTES:
        sys.exit(f"corpus is {len(corpus)} bytes, over the {MAX_BYTES} limit")
    with open(args.out, "wb") as f:
        f.write(corpus)
    print(f"wrote {args.out}: {len(corpus)} bytes from {len(parts)} files")


if __name__ == "__main__":
    main()
