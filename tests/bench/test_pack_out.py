"""bench/pack_out.py: a device call's $OUT packed into out.tgz + manifest.txt (the device
returns at most 8 files, two folders down), nothing lost: every file's bytes come back from
the archive, deeper folders included, and the originals are gone only after the archive is
whole."""
from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_pack_keeps_every_file_and_lists_it(tmp_path):
    out = tmp_path / "out"
    files = {f"gs/run{i}.log": f"line {i}\n".encode() * (i + 1) for i in range(6)}
    files.update({"conv/a/b/c/deep.jsonl": b'{"step": 1}\n', "u.json": b"{}",
                  "bin.dat": bytes(range(256)) * 9})
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pack_out.py"), str(out)],
                          capture_output=True, text=True, check=True)
    assert f"{len(files)} files" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["manifest.txt", "out.tgz"]
    listed = dict(line.split("\t")[::-1] for line in (out / "manifest.txt").read_text().split("\n")
                  if line)
    assert {k: int(v) for k, v in listed.items()} == {k: len(v) for k, v in files.items()}
    with tarfile.open(out / "out.tgz") as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert got == files


def test_pack_refuses_a_missing_folder(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import pack_out
    finally:
        sys.path.remove(str(ROOT / "bench"))
    with pytest.raises(ValueError, match="not a folder"):
        pack_out.pack(tmp_path / "missing")
