#!/usr/bin/env bash
# One line naming the CPU CI runs on, for the top and the end of .ci/run's output: model, vendor
# family and model number, cores, the vector extensions that decide torch's BF16 matmul and
# Inductor's C++ code, and (given a Python with torch) Inductor's vector ISA and whether torch's
# BF16 matmul has a fast kernel here. Suites' times differ 2-4x between these CPUs; a phase time
# means little without this line beside it.
#   bash .ci/cpu.sh [PYTHON]
set -u
field() { grep -m1 "^$1[[:space:]]*:" /proc/cpuinfo 2>/dev/null | cut -d: -f2- | xargs; }
model=$(field "model name")
family=$(field "cpu family")
number=$(field "model")
flags=" $(field flags) "
have=""
for f in avx2 avx512f avx512_bf16 amx_bf16; do
    [[ $flags == *" $f "* ]] && have+="$f "
done
line="cpu: ${model:-$(uname -m)} (family ${family:-?}, model ${number:-?}), $(nproc) cores, ${have:-no AVX2}"
line=${line% }
if [ -n "${1:-}" ]; then
    line+=$("$1" - <<'EOF' 2>/dev/null
import torch
from torch._inductor import cpu_vec_isa
isa = cpu_vec_isa.pick_vec_isa()
# (oneDNN's BF16 matmul needs AVX-512 or AMX; without it torch's CPU BF16 matmul runs a plain
# loop: 0.7-0.8 GFLOP/s on 2 cores against FP32's 30-40)
fast = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
print(f"; Inductor's ISA: {isa or 'none'}; torch's BF16 matmul: "
      f"{'oneDNN' if fast else 'no fast kernel'}", end="")
EOF
)
fi
echo "$line"
