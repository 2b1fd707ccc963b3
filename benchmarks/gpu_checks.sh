#!/usr/bin/env bash
# Every GPU check of the decode engine, in one run, for a machine with an NVIDIA GPU:
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]          # default OUT_DIR: $OUT, else /tmp/kvtui-gpu
#
# 1. the tests marked `cuda` (skipped on a machine without one);
# 2. `kvtui bench --device cuda --json --record` on tiny, shape:llama-3.2-1b and
#    shape:llama-3.1-8b: both loops, same tokens, KV bytes measured against the formula, and every
#    step recorded, so the run can be replayed on a laptop (`kvtui --engine replay:FILE`);
# 3. the KV pool: shape:llama-3.1-8b with `--kv-budget 32MiB` (256 positions of 128 KiB: the
#    cached loop must stop out_of_memory after 256 - 44 + 1 = 213 tokens), and the default run's
#    pool (the GPU's share, --gpu-memory-utilization 0.9) as the engine sized it; then a batch
#    sweep, --batch 1,4,16,64 on shape:llama-3.1-8b: tokens/s and achieved bandwidth per batch;
# 4. a summary: tokens/s, identical ids, the pool, KV bytes allocated and filled against the
#    formula, how the cached loop ended, the memory bandwidth a cached step achieves
#    (weights + KV bytes read / step time) against the GPU's peak from NVML, and each loop's
#    FLOPs as torch's FlopCounterMode counted them on the sampled steps against the formula's
#    (on CUDA the attention kernels are flash or memory-efficient SDPA: kvtui.gpu.counting's
#    formulas for them are exercised here first).
# 5. the cache's tricks: `kvtui tricks` on the shipped model, and fp8 and int8 caches on the
#    32 MiB pool (the cached loop only): bytes per token, and where each stops against its prediction.
#
# DEVICE, ENGINES and TOKENS override the defaults (DEVICE=cpu ENGINES=tiny TOKENS=32 tries the
# script itself on a CPU). The script goes on past a failed check; its exit status says whether
# any failed.
set -u
out=${1:-${OUT:-/tmp/kvtui-gpu}}
device=${DEVICE:-cuda}
engines=${ENGINES:-tiny shape:llama-3.2-1b shape:llama-3.1-8b}
tokens=${TOKENS:-256}
mkdir -p "$out"
failed=0

nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || echo "nvidia-smi: not available" | tee -a "$out/nvidia-smi.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
    | tee "$out/torch.txt"

echo "== tests marked cuda"
python -m pytest -q -m cuda tests 2>&1 | tee "$out/pytest-cuda.txt" | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

for engine in $engines; do
    name=${engine//:/-}
    echo "== kvtui bench --engine $engine --device $device --tokens $tokens"
    if ! python -m kvtui bench --engine "$engine" --device "$device" --tokens "$tokens" --seed 1 \
        --json --record "$out/$name.jsonl" >"$out/$name.json" 2>"$out/$name.err"; then
        failed=1
        tail -3 "$out/$name.err"
    fi
done

budgeted=${BUDGETED:-shape:llama-3.1-8b}
echo "== kvtui bench --engine $budgeted --device $device --tokens 400 --kv-budget 32MiB"
if ! python -m kvtui bench --engine "$budgeted" --device "$device" --tokens 400 --seed 1 \
    --kv-budget 32MiB --json >"$out/budget-32MiB.json" 2>"$out/budget-32MiB.err"; then
    failed=1
    tail -3 "$out/budget-32MiB.err"
fi

echo "== kvtui bench --engine $budgeted --device $device --tokens 128 --batch 1,4,16,64"
if ! python -m kvtui bench --engine "$budgeted" --device "$device" --tokens 128 --seed 1 \
    --batch 1,4,16,64 --json >"$out/batch-sweep.json" 2>"$out/batch-sweep.err"; then
    failed=1
    tail -3 "$out/batch-sweep.err"
fi
python - "$out/batch-sweep.json" <<'EOF' | tee "$out/batch-sweep.txt"
import json
import sys

try:
    sweep = json.load(open(sys.argv[1]))["sweep"]
except (OSError, ValueError, KeyError):
    sys.exit(f"batch sweep: no result (see {sys.argv[1]})")
for r in sweep:
    c, bw = r["cached"], r.get("achieved_bandwidth_bytes_per_s") or 0
    print(
        f"batch {r['batch']}: {c['tokens_per_s_per_sequence']:.1f} tok/s per sequence, "
        f"{c['tokens_per_s_total']:.1f} in all, TPOT {(c['tpot_s'] or 0) * 1e3:.2f} ms, "
        f"reads {bw / 1e9:.0f} GB/s, {r['flops_per_byte'] or 0:.1f} FLOPs/byte "
        f"(ridge {r.get('ridge_flops_per_byte')})"
    )
EOF

# The cache's tricks on the GPU (issue 21's kernels were measured on the CPU only): the table on the
# shipped model, then fp8 and int8 caches on a catalog shape under the 32 MiB pool, the cached loop
# only: bytes per token measured against the formula, where each stops against the plain 213.
echo "== kvtui tricks --device $device --json"
if ! python -m kvtui tricks --device "$device" --json >"$out/tricks.json" 2>"$out/tricks.err"; then
    failed=1
    tail -3 "$out/tricks.err"
fi
for kv_dtype in fp8 int8; do
    echo "== kvtui bench --engine $budgeted --device $device --kv-cache-dtype $kv_dtype --kv-budget 32MiB"
    if ! python -m kvtui bench --engine "$budgeted" --device "$device" --tokens 1000 --seed 1 \
        --kv-budget 32MiB --kv-cache-dtype "$kv_dtype" --loops cached --json \
        >"$out/budget-32MiB-$kv_dtype.json" 2>"$out/budget-32MiB-$kv_dtype.err"; then
        failed=1
        tail -3 "$out/budget-32MiB-$kv_dtype.err"
    fi
done
python - "$out" <<'EOF2' | tee "$out/tricks.txt"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
try:
    table = json.loads((out / "tricks.json").read_text())
except (OSError, ValueError):
    table = None
    print(f"tricks: no result (see {out / 'tricks.err'})")
for row in (table or {}).get("rows", []):
    quality, speed = row.get("quality") or {}, row.get("speed") or {}
    print(
        f"{row['key']} ({row['how']}): {row.get('kv_bytes_per_token')} B/token measured, "
        f"{row.get('kv_bytes_per_token_formula')} by the formula; {row.get('steps')} tokens, "
        f"stopped {row.get('stopped')}, predicted {row.get('tokens_before_full_predicted')}; nats/byte "
        f"{quality.get('nats_per_byte')} vs {quality.get('nats_per_byte_baseline')}; "
        f"{speed.get('vs_plain_in_turns')}x the plain step time ({speed.get('in_turns')})"
    )
for kv_dtype in ("fp8", "int8"):
    path = out / f"budget-32MiB-{kv_dtype}.json"
    try:
        c = json.loads(path.read_text())["cached"]
    except (OSError, ValueError, KeyError):
        print(f"{kv_dtype}: no result (see {path.with_suffix('.err')})")
        continue
    ended = c.get("finished") or {}
    print(
        f"{kv_dtype} cache: {c.get('kv_bytes_per_token')} B/token measured, "
        f"{c.get('kv_bytes_per_token_formula')} by the formula; cached loop {ended.get('reason')} "
        f"after {ended.get('steps')} tokens (predicted {c.get('tokens_before_full_predicted')}), "
        f"{c['tokens_per_s']:.1f} tok/s"
    )
EOF2

echo "== summary"
python - "$out" $engines budget-32MiB <<'EOF' | tee "$out/summary.txt"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
for engine in sys.argv[2:]:
    path = out / f"{engine.replace(':', '-')}.json"
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"{engine}: no result (see {path.with_suffix('.err')})")
        continue
    c, u = r["cached"], r["uncached"]
    achieved, peak = r.get("achieved_bandwidth_bytes_per_s"), r.get("peak_bandwidth_bytes_per_s")
    share = f" = {achieved / peak:.0%} of peak {peak / 1e9:.0f} GB/s" if achieved and peak else ""
    pool = r.get("kv_capacity_bytes")
    pool_words = (
        f"pool {pool / 2**30:.2f} GiB ({r.get('kv_pool_source')}), blocks of {r['kv_block_tokens']}"
        if pool is not None
        else "no pool"
    )
    ended = c["finished"] or {}
    print(
        f"{engine} on {r['device']} ({r['dtype']}): cached {c['tokens_per_s']:.1f} tok/s "
        f"(p50 {c['step_ms_p50']:.2f} ms), uncached {u['tokens_per_s']:.1f} tok/s; "
        f"identical={r['identical']} over {r['compared_tokens']}; {pool_words}; KV "
        f"{r['kv_bytes_allocated']:,} B allocated ({r['kv_blocks_allocated']} blocks), "
        f"{r['kv_bytes_filled']:,} B filled, {r['kv_bytes_formula']:,} B by the formula; "
        f"cached loop {ended.get('reason')} after {ended.get('steps')} tokens "
        f"{ended.get('message', '')}; cached step reads {(achieved or 0) / 1e9:.1f} GB/s{share}"
    )
    for loop in ("cached", "uncached"):
        counted, formula = r[loop].get("flops_counted"), r[loop].get("flops_formula")
        if counted is None:
            print(f"  {loop}: no FLOPs counted")
        else:
            ratio = counted / formula if formula else float("nan")
            print(
                f"  {loop}: FLOPs counted {counted:,} over {r[loop]['flops_sampled_steps']} "
                f"sampled steps, formula {formula:,} ({ratio:.4f}x)"
            )
EOF
exit $failed
