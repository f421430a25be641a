# Sourced by bench/run_*.sh: torchao is not on the GPU image (no internet there), so it comes
# from a wheel carried in .whl/ (run with carry=[".whl"]) and is put on PYTHONPATH.
# --upgrade: a warm machine already has /tmp/site from an earlier call.
if [ -z "${DRY:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
