"""Pack a device call's ``$OUT`` into two files: ``out.tgz`` and ``manifest.txt``.

The device machine sends back at most 8 files from ``$OUT``, and only those no more than two
folders down (the device tool's README, "Limits"). A call that runs several suites writes more:
on 2026-11-29 a GPU suite log and an upstream-tests JSON were lost that way. End such a call with
``python3 bench/pack_out.py "$OUT"``: every file under ``$OUT`` goes into ``$OUT/out.tgz`` (paths
relative to ``$OUT``) and is removed, and ``$OUT/manifest.txt`` lists them with their sizes.
Unpack here with ``tar xzf out.tgz -C <folder>``.

    python3 bench/pack_out.py "$OUT"
"""
from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

ARCHIVE, MANIFEST = "out.tgz", "manifest.txt"


def pack(root: Path) -> list[tuple[str, int]]:
    """Move every file under ``root`` (but an earlier archive or manifest) into
    ``root/out.tgz``; write ``root/manifest.txt``; return ``(relative path, bytes)`` per file.

    Raises:
        ValueError: ``root`` is not a folder.
    """
    if not root.is_dir():
        raise ValueError(f"pack_out: {root} is not a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                   and p.relative_to(root).as_posix() not in (ARCHIVE, MANIFEST))
    entries = [(p.relative_to(root).as_posix(), p.stat().st_size) for p in files]
    tmp = root / (ARCHIVE + ".part")
    with tarfile.open(tmp, "w:gz") as tar:
        for path, (name, _) in zip(files, entries):
            tar.add(path, arcname=name)
    tmp.replace(root / ARCHIVE)  # written whole before any original is removed
    for path in files:
        path.unlink()
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
    (root / MANIFEST).write_text("".join(f"{size}\t{name}\n" for name, size in entries))
    return entries


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="the folder to pack ($OUT)")
    args = p.parse_args(argv)
    entries = pack(args.root)
    print(f"pack_out: {len(entries)} files, {sum(s for _, s in entries)} bytes -> "
          f"{args.root / ARCHIVE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
