# Sourced by the run_*.sh call scripts on the device machine: logs to stdout, points the loader at
# the CUDA libraries the binaries load at run time, enters .gpu/ and unpacks the binaries named
# in the arguments (stripped and gzipped here, see docs/performance.md).
exec 2>&1
stamp() { echo "=== $(date +%T) $*"; }
gpu_setup() {
  local l d b
  for l in libnvrtc.so libcublasLt.so libcublas.so libnccl.so; do
    d=$(dirname "$(find / -name "$l*" -not -path '*/proc/*' 2>/dev/null | grep -v stubs | head -1)")
    export LD_LIBRARY_PATH=$d:$LD_LIBRARY_PATH
  done
  G=$PWD/.gpu
  cd "$G" || exit 1
  for b in "$@"; do gunzip -c "$b.gz" > "$b"; chmod +x "$b"; done
}
