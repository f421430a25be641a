#!/usr/bin/env bash
# Materialize transformers' FP8 GEMM hub kernel (kernels-community/finegrained-fp8) offline.
#
# transformers 5.x runs FP8Linear through the Triton kernel it downloads from the Hugging Face
# hub with the `kernels` package (`get_kernel("kernels-community/finegrained-fp8", version=4)`).
# The GPU machine has neither internet nor `kernels`, so on THIS machine we copy the kernel's
# Python/Triton source from the local git mirror of github.com/huggingface/kernels-community
# into the gitignored .hubkernels/finegrained_fp8/ and carry that directory to the GPU machine
# (run with carry=[".hubkernels"]); tests/export/helpers.py registers it where the hub download
# would go. Nothing here is committed: the copied files stay third-party source.
#
# The kernel is "torch-noarch" (pure Python + Triton); kernel-builder's only generated file for
# such a build is _ops.py (the torch.ops namespace the triton_op's register under), written
# below from its noarch template.
#
#   bash bench/hub_kernel_offline.sh            # -> .hubkernels/finegrained_fp8/
#   KERNELS_MIRROR=/path/to/repo KERNEL_COMMIT=<sha> bash bench/hub_kernel_offline.sh
set -euo pipefail

MIRROR=${KERNELS_MIRROR:-/work/.mirror/huggingface+kernels-community/repo}
# Last commit touching finegrained-fp8 in the mirror (2026-07-15, #1028): build.toml version 4,
# the major version transformers 5.17 and 5.23 both request in _HUB_KERNEL_MAPPING, and it
# exports the matmul_2d / matmul_batched / matmul_grouped symbols both versions require.
COMMIT=${KERNEL_COMMIT:-1994f2b5518dabf3a305c785ab05ac25fb28ddda}
SRC=finegrained-fp8/torch-ext/finegrained_fp8
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=$ROOT/.hubkernels/finegrained_fp8

git_() { git --git-dir="$MIRROR" "$@"; }

git_ cat-file -e "$COMMIT^{commit}" 2>/dev/null \
  || { echo "commit $COMMIT not in mirror $MIRROR" >&2; exit 1; }
version=$(git_ show "$COMMIT:finegrained-fp8/build.toml" | sed -n 's/^version *= *//p' | head -1)

# Fresh copy each time: a stale file from another revision must not linger.
rm -rf "$DEST"
mkdir -p "$DEST"
files=$(git_ ls-tree --name-only "$COMMIT" "$SRC/")
for f in $files; do
  git_ show "$COMMIT:$f" > "$DEST/$(basename "$f")"
done

# kernel-builder names the namespace _<python name>_<first 7 hex of the source tree id>
# (build2cmake ops_identifier.rs); we use the tree of $COMMIT, since the hub build's own
# id is not recoverable offline. Only the name's uniqueness matters to torch.library.
ops_name="_finegrained_fp8_$(git_ rev-parse "$COMMIT^{tree}" | cut -c1-7)"
cat > "$DEST/_ops.py" <<EOF
# Written by bench/hub_kernel_offline.sh in place of kernel-builder's generated noarch _ops.py:
# the torch.ops namespace this build's triton_op's register under.
import torch
ops = torch.ops.$ops_name

def add_op_namespace_prefix(op_name: str):
    """
    Prefix op by namespace.
    """
    return f"$ops_name::{op_name}"
EOF

# Provenance, read by tests/export/helpers.py and printed with the GPU test's result line.
sha=$(git_ rev-parse "$COMMIT")
cat > "$DEST/SOURCE.json" <<EOF
{"repo": "huggingface/kernels-community", "path": "$SRC", "commit": "$sha",
 "build_version": ${version:-null}, "ops_namespace": "$ops_name"}
EOF
echo "finegrained-fp8 @ ${sha:0:12} (version ${version:-?}) -> $DEST:" $(ls "$DEST")
