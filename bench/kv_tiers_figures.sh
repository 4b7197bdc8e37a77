#!/usr/bin/env bash
# The small figures of docs/results.md#kv-offload-and-routers: CPU offload sizes on one H100 with a
# small GPU pool, and the routers on 4 replicas, on Mooncake's synthetic trace (first 200 requests, 64% repeated prefix blocks).
# Usage: bench/kv_tiers_figures.sh OUTDIR   (prints one JSON line per run)
set -euo pipefail
out=${1:-/tmp/kv-tiers}
common=(--trace mooncake-synthetic --max-requests 200 --quiet --overwrite)
run() { local name=$1; shift; kvsim simulate "${common[@]}" -o "$out/$name" "$@" >/dev/null
  python - "$out/$name/summary.json" "$name" <<'PY'
import json, sys
s = json.load(open(sys.argv[1])); o = s.get("kv_offload") or {}
print(json.dumps({"run": sys.argv[2], "ttft_mean_s": round(s["ttft_mean_s"], 3), "ttft_p90_s": round(s["ttft_p90_s"], 3),
                  "throughput_total_tok_s": round(s["throughput_total_tok_s"]), "prefix_hit_rate": round(s["prefix_hit_rate"], 3),
                  "cpu_hit_rate": round(o.get("external_prefix_cache_hit_rate", 0.0), 3),
                  "gib_to_cpu": round(o.get("bytes_to_tier", 0) / 2**30, 1), "gib_from_cpu": round(o.get("bytes_from_tier", 0) / 2**30, 1),
                  "wall_s": round(s["wall_s"], 1)}))
PY
}
for cpu in none 16 64; do
  if [ "$cpu" = none ]; then run "offload-$cpu" --num-gpu-blocks 4000; else run "offload-$cpu" --num-gpu-blocks 4000 --kv-offload "cpu:${cpu}GiB"; fi
done
for router in round_robin least_outstanding queue_depth kv_usage prefix_affinity precise_prefix weighted; do
  run "router-$router" --replicas 4 --num-gpu-blocks 4000 --router "$router"
done
