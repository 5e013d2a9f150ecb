#!/usr/bin/env bash
# gpu_check.sh: what lowprec does on a GPU, in one command that keeps to a time budget.
#
#   OUT=dir bash benchmarks/gpu_check.sh      # from anywhere; it runs from the repository root
#
# Needs PyTorch (with CUDA and Triton for the GPU sections) and nothing else of lowprec's:
# it puts src/ on PYTHONPATH, installs nothing and needs no network. Sections, most informative
# first, each with its own log and a status (pass, fail or skip, with a one-line reason):
#   1 versions     python, torch, CUDA, cuDNN, Triton, GPU, driver, CPU; every Inductor option
#                  lowprec compiles with present; whether the default step compiles here
#   2 fused        benchmarks/fused_check.py: fused == eager bit for bit, every optimizer x
#                  master x dtype and 8-bit state; a fallback to eager is a failure
#   3 pytest       python -m pytest -m gpu -v over tests/ (pytest-xdist workers where it is
#                  installed): each test's outcome, also of a run its time limit cut short
#   4 bench        benchmarks/step_profile.py (host launch time against device time, kernels
#                  per step), benchmarks/step_calls.py (host calls per step against the number
#                  of tensors), then benchmarks/optimizer_step.py on CUDA: the default step's BF16
#                  rows against torch's fused FP32 and BF16 AdamW (same-run ratios, %axpy)
#   5 choices      benchmarks/device_choices.py and benchmarks/fast_path.py on CUDA
#   6 train        lowprec compare and lowprec memory on CUDA; the FSDP2 and DDP 1-bit
#                  examples on one rank (torchrun)
# Without a GPU (CI) it runs the CPU-possible parts small (the fused check's --quick subset,
# a quick benchmark, device_choices --quick, the examples eagerly for a few steps) and reports
# the GPU-only ones as skipped.
#
# Time: the whole run keeps to GPU_CHECK_BUDGET_S seconds (default 500 with a GPU, 170
# without). Each section runs under `timeout` with at most its own cap, and never eats into the
# minimum the sections after it need; a section that no longer fits is skipped, saying so.
# Outputs: every log, summary.md and summary.json in $OUT (default gpu-check-out/<UTC time>).
# The exit status is 1 if a section failed, else 0. Environment: PYTHON (default python, else
# python3), OUT, GPU_CHECK_BUDGET_S.
set -u

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
START=$(date +%s)
OUT=${OUT:-$ROOT/gpu-check-out/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
: >"$OUT/sections.tsv"
echo "gpu_check: logs and summary in $OUT"

# Only a fallback warning of lowprec's compiled step (tests/_fallback.py's FALLBACK_WARNING; a
# pytest filter cannot hold a colon, hence "lowprec." for "lowprec:"): an error in section 3.
FALLBACK_FILTER='error:lowprec. (the fused \(torch\.compile\)|no C\+\+ compiler|Triton is not installed|no fused step):RuntimeWarning'

GPU=0
if timeout -k 5 120 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1; then
    GPU=1
fi
if ((GPU)); then BUDGET=${GPU_CHECK_BUDGET_S:-500}; else BUDGET=${GPU_CHECK_BUDGET_S:-170}; fi
DEADLINE=$((START + BUDGET))
NPROC=$(nproc 2>/dev/null || echo 2)
echo "gpu_check: $( ((GPU)) && echo "a GPU is present" || echo "no GPU: CPU mode" ); budget ${BUDGET} s"

now() { date +%s; }
min() { if (($1 < $2)); then echo "$1"; else echo "$2"; fi; }

# run LIMIT LOG CMD...: CMD under `timeout` (SIGTERM at LIMIT s, SIGKILL 10 s later; the whole
# process group), stdout and stderr to LOG; returns CMD's status (124: timed out).
run() {
    local limit=$1 log=$2
    shift 2
    echo "\$ $*" >"$log"
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
}

# Each section function gets its time limit in seconds, writes its logs as $OUT/<name>*.log and
# its key lines to $KEY, and sets STATUS (pass, fail, skip) and REASON (one line).
key() { printf '%s\n' "$@" >>"$KEY"; }

# ------------------------------------------------------------------------------ 1 versions
sec_versions() {
    local log="$OUT/1-versions.log" rc
    run "$1" "$log" "$PY" - "$GPU" <<'PY'
import os, platform, subprocess, sys

gpu = sys.argv[1] == "1"
key = open(os.environ["KEY"], "a")
lines, failures = [], []


def say(line):
    print(line)
    lines.append(line)


say(f"python {platform.python_version()} ({sys.executable})")
import torch

cuda = torch.version.cuda or "none"
cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none"
try:
    import triton
    triton_v = triton.__version__
except Exception as e:
    triton_v = f"not importable ({type(e).__name__})"
say(f"torch {torch.__version__}, CUDA {cuda}, cuDNN {cudnn}, Triton {triton_v}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        say(f"GPU {i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB")
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    say("nvidia-smi: " + ("; ".join(smi.stdout.strip().splitlines()) or smi.stderr.strip()))
    if smi.returncode == 0 and smi.stdout.strip() and not gpu:
        # (CPU mode would report every GPU section as skipped: say why there is no GPU.)
        failures.append("nvidia-smi lists a GPU but torch.cuda.is_available() is False (a CPU "
                        "build of torch, or a driver torch cannot use)")
except (OSError, subprocess.SubprocessError) as e:
    say(f"nvidia-smi: not run ({type(e).__name__})")
cpu = platform.processor() or "?"
try:
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
except OSError:
    pass
say(f"CPU: {cpu}, {os.cpu_count()} logical cores")
import lowprec
from lowprec.optim import compiled, vector_casts

say(f"lowprec {lowprec.__version__} from {os.path.dirname(lowprec.__file__)}")
options = compiled.inductor_options()
missing = [name for name, found in options.items() if not found]
say("Inductor options lowprec sets: " + ", ".join(
    f"{name} {'yes' if found else 'MISSING'}" for name, found in options.items()))
if missing:
    failures.append(f"Inductor lacks {', '.join(missing)}: every fused step falls back")
say(f"vector casts (CPU C++ kernels): {'available' if vector_casts.available() else 'not available'}")
# The device the check is about must compile the default step; the other is reported.
for device in (["cuda", "cpu"] if gpu else ["cpu"]):
    why = compiled._compiler(device)
    say(f"default step on {device}: " + ("compiled" if not why else f"EAGER: {why[:160]}"))
    if why and device == ("cuda" if gpu else "cpu"):
        failures.append(f"the default step does not compile on {device}")
for mod in ("rich", "matplotlib", "hypothesis", "transformers", "accelerate", "lightning"):
    try:
        __import__(mod)
        found = "yes"
    except Exception as e:
        found = f"no ({type(e).__name__})"
    say(f"import {mod}: {found}")
key.write("\n".join(ln for ln in lines if not ln.startswith("import ")) + "\n")
key.write("imports: " + ", ".join(ln[len("import "):] for ln in lines if ln.startswith("import "))
          + "\n")
if failures:
    print("FAIL: " + "; ".join(failures))
    sys.exit(1)
PY
    rc=$?
    if ((rc == 0)); then
        STATUS=pass
        REASON=$( ((GPU)) && echo "the default step compiles on cuda" \
                  || echo "the default step compiles on cpu")
    else
        STATUS=fail
        REASON=$(grep -m1 '^FAIL: ' "$log" | cut -c7-)
        [[ -n $REASON ]] || REASON="exit $rc: $(tail -n1 "$log")"
    fi
}

# ------------------------------------------------------------------------ 2 fused == eager
sec_fused() {
    local log="$OUT/2-fused.log" rc args
    if ((GPU)); then
        # Workers compile in parallel: half the cores, at most 6 (each holds a CUDA context).
        local jobs=$((NPROC / 2)); ((jobs > 6)) && jobs=6; ((jobs < 1)) && jobs=1
        # Start no variant in the last 60 s: the ones under way finish (a variant takes up to
        # 25 s on an H200, its worker's start more), the rest are SKIPPED.
        args=(--device cuda --jobs "$jobs" --budget-s $(($1 - 60)))
    else
        args=(--device cpu --quick)
    fi
    run "$1" "$log" "$PY" benchmarks/fused_check.py "${args[@]}" --json "$OUT/fused_check.json"
    rc=$?
    grep -E '^fused check on' "$log" >>"$KEY"
    grep -E '  (DIFFERS|FALLBACK|ERROR) ' "$log" | head -n 12 >>"$KEY"
    local last
    last=$(grep -E '^fused check on' "$log" | cut -d: -f2- | sed 's/^ //')
    case $rc in
        0) STATUS=pass; REASON="${last:-every variant equal}" ;;
        124 | 137) STATUS=fail
                   REASON="timed out after $1 s: $(grep -cE ': equal \[' "$log") variants equal, $(
                       grep -cE ': (DIFFERS|FALLBACK|ERROR)' "$log") not, before it" ;;
        *) STATUS=fail; REASON="${last:-exit $rc: $(tail -n1 "$log")}" ;;
    esac
    if ((!GPU)); then REASON="CPU, --quick subset: $REASON"; fi
}

# ---------------------------------------------------------------------------- 3 pytest -m gpu
# One run over tests/, -v: each test's outcome is in the log as it happens, so a run its time
# limit ends still names what passed and what failed. With pytest-xdist, half the cores (at
# most 6) as workers, each with its own CUDA context.
sec_pytest() {
    if ((!GPU)); then STATUS=skip; REASON="no GPU"; return; fi
    local log="$OUT/3-pytest.log" rc jobs par=() counts
    "$PY" -c 'import rich' >/dev/null 2>&1 \
        || key "rich does not import: tests that run the lowprec command (its cli extra) fail"
    if "$PY" -c 'import xdist' >/dev/null 2>&1; then
        jobs=$((NPROC / 2)); ((jobs > 6)) && jobs=6; ((jobs < 1)) && jobs=1
        par=(-n "$jobs")
    fi
    # -o faulthandler_timeout: a test past 60 s dumps every thread's stack into the log, so a
    # hang that `timeout` then ends shows where it hung.
    run "$1" "$log" "$PY" -m pytest -m gpu -v -rfE --tb=line -p no:cacheprovider "${par[@]}" \
        -o faulthandler_timeout=60 -o "filterwarnings=$FALLBACK_FILTER" tests
    rc=$?
    counts=$("$PY" - "$log" 2>&1 <<'PY'
import collections, re, sys

# "tests/f.py::t[x] PASSED [ 5%]" (one process) or "[gw0] [ 5%] PASSED tests/f.py::t[x]"
# (xdist); the -rfE summary's "FAILED tests/f.py::t[x] - message" lines are kept apart.
outcome = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
node = re.compile(r"(tests/[^\s:]+\.py)::(\S+)")
per_file = collections.defaultdict(collections.Counter)
bad, summary = [], []
for line in open(sys.argv[1], errors="replace"):
    line = line.rstrip()
    o, n = outcome.search(line), node.search(line)
    if not (o and n):
        continue
    if line.startswith(("FAILED ", "ERROR ")):
        summary.append(line[:300])
        continue
    per_file[n.group(1)][o.group(1)] += 1
    if o.group(1) in ("FAILED", "ERROR"):
        bad.append(f"{o.group(1)} {n.group(0)}")
total = collections.Counter()
for f, c in sorted(per_file.items()):
    total.update(c)
    print(f"KEY {f}: " + ", ".join(f"{v} {k.lower()}" for k, v in sorted(c.items())))
for line in (summary or bad)[:10]:
    print(f"KEY {line}")
if len(summary or bad) > 10:
    print(f"KEY ... and {len(summary or bad) - 10} more (3-pytest.log)")
print(f"{total['PASSED']} {total['FAILED'] + total['ERROR']} {total['SKIPPED']}")
PY
)
    grep '^KEY ' <<<"$counts" | cut -c5- >>"$KEY"
    local p f s
    read -r p f s < <(tail -n1 <<<"$counts")
    p=${p:-0} f=${f:-0} s=${s:-0}
    case $rc in
        0) if ((p > 0)); then STATUS=pass; REASON="$p passed, $s skipped"
           else STATUS=skip; REASON="no test passed (every one skipped or none collected)"; fi ;;
        124 | 137) STATUS=fail
                   REASON="timed out after $1 s: $p passed, $f failed so far (stacks in 3-pytest.log)" ;;
        *) STATUS=fail; REASON="$f failed, $p passed, $s skipped (exit $rc)" ;;
    esac
}

# ------------------------------------------------------------------ 4 optimizer-step benchmark
# The default step's BF16 rows (Kahan, and under a loss scaler, split, stochastic rounding,
# 8-bit state) and torch's fused BF16 AdamW; torch's fused FP32 AdamW comes with them (the
# x fused column's reference).
BENCH_ROWS=lowprec-adamw-bf16-kahan-default,lowprec-adamw-bf16-split-default,lowprec-adamw-bf16-stochastic-default,lowprec-adamw-bf16-kahan-state8bit-default,torch-adamw-bf16-fused

sec_bench() {
    local log="$OUT/4-bench.log" json="$OUT/optimizer_step.json" rc plog="$OUT/4-profile.log" t
    # First where the step's time goes (host launch time, device time, kernels per step).
    if ((GPU)); then
        t=$(min 75 $(($1 / 2)))
        run "$t" "$plog" "$PY" benchmarks/step_profile.py --device cuda --steps 10
    else
        t=$(min 40 $(($1 / 3)))
        run "$t" "$plog" env LOWPREC_FUSED=0 "$PY" benchmarks/step_profile.py --device cpu \
            --params-millions 0.2 --warmup 1 --steps 1 --profile-steps 1 --top 5 \
            --configs torch-fp32-fused,lowprec-kahan-eager
    fi
    rc=$?
    ((rc == 0)) || key "step_profile.py: exit $rc after at most $t s (4-profile.log)"
    sed -n '/^config /,/^$/p' "$plog" | grep -v '^$' | sed 's/^/profile: /' >>"$KEY"
    if ((GPU)); then
        # Host calls per step and time against the number of tensors (buckets, the step
        # without them, under a loss scaler, with 8-bit moments, LAMB as rows, torch's fused
        # FP32 AdamW; issue 39's targets): 100M parameters in 128 tensors first (each layout
        # prints when its rows are done), then 16 and 512 small tensors.
        t=$(min 60 $(($1 / 3)))
        run "$t" "$OUT/4-calls.log" "$PY" benchmarks/step_calls.py --device cuda --rounds 10 \
            --layouts 128x781250,16x4096,512x4096 \
            --rows torch-adamw-fp32,adamw-kahan,adamw-kahan-per-tensor,adamw-kahan-scaled,adamw-kahan-8bit,lamb-kahan
        grep -E '^(adamw|lamb|torch|[0-9]+x)' "$OUT/4-calls.log" | sed 's/^/calls: /' >>"$KEY"
    fi
    t=$(($1 - ($(now) - SECTION_START)))
    if ((t < 20)); then
        STATUS=fail; REASON="no time left for optimizer_step.py after the profile"; return
    fi
    if ((GPU)); then
        # 100M parameters (8 blocks of width 1024, 128 tensors): a step of torch's fused FP32
        # AdamW moves 1.6 GB, long enough against launch and host costs to show bandwidth.
        # --row-seconds 60: every row warms up fully (3 steps) and takes its 10 timed steps per
        # round. (The script counts a lowprec row as compiled by whether the CPU compiles: with
        # a smaller budget a row whose first step compiled for seconds would stop warming up
        # there and time its second step, which compiles the shared calls.)
        run "$t" "$log" "$PY" benchmarks/optimizer_step.py --device cuda --rows "$BENCH_ROWS" \
            --lowprec-variants default --params-millions 100 --rounds 2 --steps 20 \
            --row-seconds 60 --retries 0 --ab-steps 10 --json "$json"
    else
        # A smoke run, smaller than --quick: 0.5M parameters, one lowprec row, eager
        # (LOWPREC_FUSED=0, as .ci/run's smoke run), so that it compiles nothing.
        run "$t" "$log" env LOWPREC_FUSED=0 "$PY" benchmarks/optimizer_step.py \
            --rows lowprec-adamw-bf16-split-default,torch-adamw-bf16-fused \
            --lowprec-variants default --params-millions 0.5 --steps 3 --warmup 1 --rounds 1 \
            --row-seconds 2 --retries 0 --ab-steps 0 --axpy-millions 4 --json "$json"
    fi
    rc=$?
    if ((rc == 124 || rc == 137)); then
        STATUS=fail; REASON="timed out after $t s (the rows it finished are in its log)"
        grep -E '^  .*ms median' "$log" >>"$KEY"
        return
    fi
    if ((rc != 0)); then STATUS=fail; REASON="exit $rc: $(tail -n1 "$log")"; return; fi
    # Per row: median, x torch fused FP32 AdamW (paired), x torch fused BF16 AdamW (medians of
    # the same run), %axpy (paired where measured). A fallback to eager in a row is a failure.
    "$PY" - "$json" "$GPU" >>"$KEY" <<'PY'
import json, sys

data = json.load(open(sys.argv[1]))
rows = {r["name"]: r for r in data["rows"]}
bf16 = rows.get("torch-adamw-bf16-fused", {}).get("median_ms")
h = data["header"]
print(f"{h.get('device')}, {h.get('params', 0) / 1e6:.1f}M params in {h.get('tensors')} tensors; axpy "
      f"{data['axpy_bytes_per_s'] / 1e9:.0f} GB/s")
bad = []
for r in data["rows"]:
    if r["status"] != "ok":
        print(f"{r['name']}: {r['status']}: {r['note']}")
        bad.append(r["name"])
        continue
    xf = r.get("vs_fused_reference_paired") or r.get("vs_fused_reference")
    frac = r.get("fraction_of_axpy_paired") or r.get("fraction_of_axpy")
    print(f"{r['name']}: {r['median_ms']:.2f} ms, "
          + (f"{xf:.2f}x torch fused fp32 (paired), " if xf else "")
          + (f"{r['median_ms'] / bf16:.2f}x torch fused bf16 (medians), " if bf16 else "")
          + (f"{100 * frac:.0f}% axpy" if frac else "") + (f" ({r['note']})" if r["note"] else ""))
    if r["source"] == "lowprec" and "warning: lowprec" in r["note"]:
        bad.append(r["name"])
if bad:
    print("FAIL: " + ", ".join(bad))
PY
    if grep -q '^FAIL: ' "$KEY"; then
        STATUS=fail; REASON="rows failed or fell back to eager: $(grep -m1 '^FAIL: ' "$KEY" | cut -c7-)"
    else
        STATUS=pass
        REASON=$(grep -m1 '^lowprec-' "$KEY" | cut -c1-120)
        ((GPU)) || REASON="CPU smoke run, eager (LOWPREC_FUSED=0): ${REASON:-ran}"
    fi
}

# --------------------------------------------------------------- 5 device choices, fast path
sec_choices() {
    local log="$OUT/5-device_choices.log" rc fails=() t
    if ((GPU)); then
        t=$(min 50 $(($1 - 25)))
        run "$t" "$log" "$PY" benchmarks/device_choices.py --device cuda --json "$OUT/device_choices.json"
    else
        run "$1" "$log" "$PY" benchmarks/device_choices.py --device cpu --quick \
            --json "$OUT/device_choices.json"
    fi
    rc=$?
    sed -n '/^device choices on/,$p' "$log" | grep -vE '^wrote |Warning' | head -n 20 >>"$KEY"
    case $rc in
        0) ;;
        124 | 137) fails+=("device_choices timed out after $t s") ;;
        *) fails+=("device_choices exit $rc") ;;
    esac
    if ((GPU)); then
        local fplog="$OUT/5-fast_path.log"
        t=$(($1 - ($(now) - SECTION_START)))
        if ((t < 15)); then
            key "fast_path.py: not run (no time left)"
        else
            run "$t" "$fplog" "$PY" benchmarks/fast_path.py --device cuda --configs adamw-kahan \
                --steps 10 --json "$OUT/fast_path.json"
            rc=$?
            sed -n '/^fast-path mechanisms on/,$p' "$fplog" | grep -vE '^wrote |Warning' \
                | head -n 8 >>"$KEY"
            case $rc in
                0) ;;
                124 | 137) fails+=("fast_path timed out after $t s") ;;
                *) fails+=("fast_path exit $rc") ;;
            esac
        fi
    else
        key "fast_path.py: not run (no GPU; its CPU figures are in benchmarks/README.md)"
    fi
    if ((${#fails[@]})); then
        STATUS=fail; REASON="${fails[*]}"
    else
        STATUS=pass
        REASON=$(grep -m1 'square roots' "$KEY" | cut -c1-120)
        ((GPU)) || REASON="CPU --quick; fast_path not run (no GPU). ${REASON}"
    fi
}

# --------------------------------------------------- 6 compare, memory, the examples on 1 rank
# lowprec compare and memory through the CLI, which needs rich (the cli extra); where rich does
# not import, through the same library calls the CLI makes, printed plainly.
write_compare_api() {
    cat >"$1" <<'PY'
import json, os, sys, time

from lowprec.comparison import config
from lowprec.comparison.compare import compare, config_dict, recommend
from lowprec.comparison.config import CompareConfig

model, batch = config.sized("medium")
cfg = CompareConfig(recipes=["fp32", "amp-bf16", "bf16", "bf16-kahan", "bf16-sr"], steps=100,
                    batch_size=batch, model=model, device="cuda")
cfg.validate()
records, started = [], time.perf_counter()
print(f"compare (library calls: rich is not installed): medium, {model.num_parameters:,} "
      f"parameters, {cfg.steps} steps, recipes {', '.join(cfg.recipes)}", flush=True)
interrupted = False
try:
    compare(cfg, on_step=lambda name, step, loss: None, records=records)
except KeyboardInterrupt:
    interrupted = True
    print("interrupted: the records hold the recipes that finished")
for r in records:
    print(f"{r['recipe']}: eval loss {r['eval_loss']}, step {r['step_time_s'] * 1e3:.1f} ms, "
          f"speed-up {r.get('speedup')}")
os.makedirs(sys.argv[1], exist_ok=True)
payload = {"command": "compare", "interrupted": interrupted, "config": config_dict(cfg),
           "wall_time_s": time.perf_counter() - started, "records": records}
if records:
    payload["recommendation"] = recommend(records)
with open(os.path.join(sys.argv[1], "compare.json"), "w") as f:
    json.dump(payload, f, indent=1, default=str)
sys.exit(130 if interrupted else 0)
PY
}

write_memory_api() {
    cat >"$1" <<'PY'
import json, sys

import torch

from lowprec import memory
from lowprec.comparison import config
from lowprec.comparison.run import task_loss
from lowprec.comparison.task import CharTransformer

model_cfg, batch = config.sized("medium")
torch.manual_seed(0)
model = CharTransformer(model_cfg).to("cuda")
rows = memory.table("adamw", model=model, keep_fp32=(), accumulate=None,
                    loss_fn=task_loss(model_cfg, batch, "cuda"))
print("memory (library calls: rich is not installed): adamw, size medium")
for r in rows:
    peak = r.get("cuda_peak") or {}
    print(f"{r['recipe']}: {r['expected']['total']:.3g} B/param expected, "
          f"{r['measured']['total']:.3f} measured; held {peak.get('held', 0) / 2**20:.1f} MiB, "
          f"peak {peak.get('peak', 0) / 2**20:.1f} MiB")
json.dump({"command": "memory", "size": "medium", "rows": rows}, open(sys.argv[1], "w"),
          indent=1, default=str)
PY
}

sec_train() {
    local rc fails=() notes=() t pids=() names=() logs=() i fused=() rich=0 plot=()
    "$PY" -c 'import rich' >/dev/null 2>&1 && rich=1
    "$PY" -c 'import matplotlib' >/dev/null 2>&1 || plot=(--no-plot)
    if ((GPU)); then
        # compare first, alone (it times steps); SIGINT at its cap: it saves what it measured.
        local clog="$OUT/6-compare.log"
        t=$(min 100 $(($1 - 45)))
        echo "\$ lowprec compare (timeout -s INT $t)" >"$clog"
        rc=0
        if ((t < 40)); then
            notes+=("compare not run (${t} s left for it, under 40)")
        elif ((rich)); then
            timeout -s INT -k 20 "$t" "$PY" -m lowprec compare --device cuda --size medium \
                --steps 100 --recipes fp32,amp-bf16,bf16,bf16-kahan,bf16-sr --no-progress \
                "${plot[@]}" --out "$OUT/compare" >>"$clog" 2>&1
            rc=$?
        else
            write_compare_api "$TMP/compare_api.py"
            timeout -s INT -k 20 "$t" "$PY" "$TMP/compare_api.py" "$OUT/compare" >>"$clog" 2>&1
            rc=$?
        fi
        if [[ -s $OUT/compare/compare.json ]]; then
            "$PY" - "$OUT/compare/compare.json" >>"$KEY" <<'PY'
import json, sys

d = json.load(open(sys.argv[1]))
c = d.get("config", {})
print(f"compare: {c.get('steps')} steps, {c.get('model', {})}"[:160]
      + (" (interrupted at its cap)" if d.get("interrupted") else ""))
for r in d["records"]:
    gap = r.get("eval_gap")
    print(f"  {r['recipe']}: eval loss {r['eval_loss']:.4f}"
          + (f" ({100 * gap:+.2f}% vs fp32)" if gap is not None else "")
          + f", step {r['step_time_s'] * 1e3:.1f} ms"
          + (f" ({r['speedup']:.2f}x fp32's speed)" if r.get("speedup") else "")
          + f", B/param {r['bytes_per_param']['total']:.1f}")
PY
        fi
        case $rc in
            0) ;;
            124 | 130) if [[ -s $OUT/compare/compare.json ]]; then notes+=("compare cut short at ${t} s")
                       else fails+=("compare: nothing measured in $t s"); fi ;;
            *) fails+=("compare exit $rc") ;;
        esac
    else
        key "compare, memory: not run (no GPU)"
        fused=(--no-fused)  # (the CPU's compiled step: tests/test_fused.py; here the plumbing)
    fi
    # memory and the two examples at once (none of them times anything).
    t=$(($1 - ($(now) - SECTION_START) - 5))
    if ((t < 15)); then
        STATUS=fail; REASON="no time left for memory and the examples (${fails[*]:-})"
        return
    fi
    if ((GPU)); then
        names+=(memory); logs+=("$OUT/6-memory.log")
        if ((rich)); then
            run "$t" "${logs[-1]}" "$PY" -m lowprec memory --device cuda --size medium \
                --json "$OUT/memory.json" &
        else
            write_memory_api "$TMP/memory_api.py"
            run "$t" "${logs[-1]}" "$PY" "$TMP/memory_api.py" "$OUT/memory.json" &
        fi
        pids+=($!)
    fi
    names+=(fsdp2); logs+=("$OUT/6-fsdp2.log")
    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo run "$t" "${logs[-1]}" "$PY" -m torch.distributed.run \
        --standalone --nproc_per_node 1 examples/fsdp2_bf16.py --steps 20 --log-every 10 \
        "${fused[@]}" &
    pids+=($!)
    names+=(ddp-onebit); logs+=("$OUT/6-ddp_onebit.log")
    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo run "$t" "${logs[-1]}" "$PY" -m torch.distributed.run \
        --standalone --nproc_per_node 1 examples/ddp_onebit.py --steps 20 --warmup-steps 5 \
        --log-every 10 "${fused[@]}" &
    pids+=($!)
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        rc=$?
        case $rc in
            0) ;;
            124 | 137) fails+=("${names[$i]} timed out after $t s") ;;
            *) fails+=("${names[$i]} exit $rc") ;;
        esac
        if [[ ${names[$i]} == memory ]]; then
            if [[ -s $OUT/memory.json ]]; then
                "$PY" - "$OUT/memory.json" >>"$KEY" <<'PY'
import json, sys

for r in json.load(open(sys.argv[1]))["rows"]:
    p = r.get("cuda_peak") or {}
    print(f"memory {r['recipe']}: {r['expected']['total']:.3g} B/param, held "
          f"{p.get('held', 0) / 2**20:.0f} MiB, peak {p.get('peak', 0) / 2**20:.0f} MiB")
PY
            fi
        else
            grep -hE '^(device: |done: |1-bit hook: )' "${logs[$i]}" | sed "s/^/${names[$i]}: /" >>"$KEY"
            # With a GPU per rank the examples must choose CUDA and NCCL.
            if ((GPU)) && ! grep -q '^device: cuda' "${logs[$i]}"; then
                fails+=("${names[$i]} did not choose CUDA")
            fi
        fi
    done
    if ((${#fails[@]})); then
        STATUS=fail; REASON="${fails[*]}"
    else
        STATUS=pass
        REASON=$( ((GPU)) && echo "compare, memory, FSDP2 and DDP 1-bit examples ran" \
                  || echo "CPU: the FSDP2 and DDP 1-bit examples ran eagerly on gloo (compare, memory: no GPU)")
        ((${#notes[@]})) && REASON="$REASON; ${notes[*]}"
    fi
}

# ----------------------------------------------------------------------------- the sections
# name, title, minimum and cap (seconds) with a GPU, and without one (a minimum of 0: it skips).
if ((GPU)); then
    PLAN=("1-versions|versions|10|45" "2-fused|fused == eager, bit for bit|60|120"
          "3-pytest|pytest -m gpu|60|150" "4-bench|step profile, optimizer-step benchmark|60|120"
          "5-choices|device_choices, fast_path|30|50"
          "6-train|compare, memory, FSDP2 + DDP 1-bit examples|60|100")
else
    PLAN=("1-versions|versions|10|45" "2-fused|fused == eager, bit for bit|30|80"
          "3-pytest|pytest -m gpu|0|0" "4-bench|step profile, optimizer-step benchmark|25|60"
          "5-choices|device_choices, fast_path|20|75"
          "6-train|compare, memory, FSDP2 + DDP 1-bit examples|20|60")
fi
FUNCS=(sec_versions sec_fused sec_pytest sec_bench sec_choices sec_train)

for i in "${!PLAN[@]}"; do
    IFS='|' read -r name title smin cap <<<"${PLAN[$i]}"
    reserve=0
    for later in "${PLAN[@]:i+1}"; do
        IFS='|' read -r _ _ m _ <<<"$later"
        reserve=$((reserve + m))
    done
    avail=$((DEADLINE - $(now) - reserve))
    limit=$(min "$cap" "$avail")
    KEY="$OUT/$name.key"
    export KEY
    : >"$KEY"
    SECTION_START=$(now)
    if ((cap == 0)); then
        STATUS=skip; REASON="no GPU"
    elif ((limit < smin || limit < 5)); then
        STATUS=skip; REASON="no time left: it needs ${smin} s, ${avail} s remain before the budget"
    else
        echo "gpu_check: [$name] $title (up to ${limit} s)"
        STATUS=fail; REASON="the section set no status"
        "${FUNCS[$i]}" "$limit"
    fi
    secs=$(($(now) - SECTION_START))
    REASON=${REASON//$'\n'/ }
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$title" "$STATUS" "$secs" "${REASON//$'\t'/ }" \
        >>"$OUT/sections.tsv"
    echo "gpu_check: [$name] $STATUS ($secs s): $REASON"
done

# ------------------------------------------------------------------------------ the summary
"$PY" - "$OUT" "$GPU" "$BUDGET" "$(($(now) - START))" <<'PY' || echo "gpu_check: (no summary.md: python failed)"
import json, pathlib, sys

out, gpu, budget, total = pathlib.Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3], sys.argv[4]
sections = []
for line in (out / "sections.tsv").read_text().splitlines():
    name, title, status, secs, reason = line.split("\t", 4)
    key = out / f"{name}.key"
    lines = [ln.rstrip() for ln in key.read_text().splitlines() if ln.strip()] if key.exists() else []
    sections.append({"section": name, "title": title, "status": status, "seconds": int(secs),
                     "reason": reason, "key_lines": lines,
                     "logs": sorted(p.name for p in out.glob(f"{name}*.log"))})
counts = {s: sum(x["status"] == s for x in sections) for s in ("pass", "fail", "skip")}
mode = "GPU" if gpu else "CPU mode (no GPU)"
summary = {"mode": mode, "budget_s": int(budget), "total_s": int(total), "counts": counts,
           "sections": sections}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
cell = lambda s: s.replace("|", "\\|")  # noqa: E731
md = [f"# gpu_check: {mode}", "",
      f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped, "
      f"in {total} s (budget {budget} s).", "",
      "| section | status | s | reason and key lines |", "|---|---|---|---|"]
for s in sections:
    body = "<br>".join(cell(x) for x in [f"**{s['reason']}**", *s["key_lines"]])
    md.append(f"| {s['section']}: {cell(s['title'])} | {s['status']} | {s['seconds']} | {body} |")
(out / "summary.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PY

read -r npass nfail nskip < <(awk -F'\t' '{c[$3]++} END {print c["pass"]+0, c["fail"]+0, c["skip"]+0}' \
                               "$OUT/sections.tsv")
echo "gpu_check: $npass passed, $nfail failed, $nskip skipped in $(($(now) - START)) s; $OUT/summary.md"
((nfail == 0))
