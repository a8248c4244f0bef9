#!/bin/sh
# compile_kernels.sh — compiles every generated kernel of test_codegen for sm_80 and sm_90 with
# nvcc, warnings as errors. Usage: KB_CODEGEN_OUT=<dir> ./test_codegen && tests/compile_kernels.sh <dir>
dir=${1:?usage: compile_kernels.sh <dir of .cu files>}
NVCC=${NVCC:-nvcc}
JOBS=${JOBS:-$(nproc)}
ls "$dir"/*.cu | xargs -P "$JOBS" -I{} sh -c '
  for arch in sm_80 sm_90; do
    '"$NVCC"' -arch=$arch -cubin -Werror all-warnings -o /dev/null "{}" 2>"{}.$arch.log" || echo "FAILED $arch {}"
  done'
n=$(ls "$dir"/*.cu | wc -l)
bad=$(find "$dir" -name "*.log" -size +0 | wc -l)
echo "$n kernels x 2 archs compiled; $bad logs with output"
[ "$bad" = 0 ]
