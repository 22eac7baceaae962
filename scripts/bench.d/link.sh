#!/usr/bin/env bash
# link.sh BUILD_DIR — `zps-bench pushpull` over a rate-limited link, f32 against bfloat16
# gradients (docs/ps.md "Wire dtypes"). Loopback on this machine is CPU-bound, so it cannot
# show what halving the bytes buys; here the whole bench (servers and clients) runs in a
# network namespace of its own whose loopback is held to ZPS_LINK_RATE (default 10gbit, a
# 10 GbE link) by a tbf qdisc. Same run, same link: zps and raw ZeroMQ with f32 pushes, then
# with bf16 pushes. Writes BUILD_DIR/bench/link.json and prints the bf16 / f32 ratios.
# Needs root (ip netns, tc); without it, says so and exits 0 (nothing measured).
set -u
B=${1:-build}
BIN=$(cd "$B/bin" && pwd)
OUT=$(mkdir -p "$B/bench" && cd "$B/bench" && pwd)
RATE=${ZPS_LINK_RATE:-10gbit}
NS=zps-link-$$
if ! ip netns add "$NS" 2>/dev/null; then
  echo "link: skipped: cannot create a network namespace here (needs root and iproute2)"
  exit 0
fi
trap 'ip netns del "$NS" 2>/dev/null' EXIT
set -e
ip netns exec "$NS" ip link set lo up
# burst: what may pass at once above the rate (a few 64 KiB loopback segments)
ip netns exec "$NS" tc qdisc add dev lo root tbf rate "$RATE" burst 512kb latency 100ms
echo "link: loopback of namespace $NS held to $RATE (tbf)"
TMP=$(mktemp -d)
trap 'ip netns del "$NS" 2>/dev/null; rm -rf "$TMP"' EXIT
for dt in f32 bf16; do
  mkdir -p "$TMP/$dt"
  echo "=== push dtype $dt"
  ZPS_BIN=$BIN ZPS_BENCH_DIR=$TMP/$dt ip netns exec "$NS" "$BIN/zps-bench" pushpull \
    --shape 1x1 --max-bytes 16777216 --reps 3 --push-dtype "$dt" | grep -v '^ps-lite'
done
python3 - "$TMP" "$OUT/link.json" "$RATE" <<'EOF'
import json, sys
tmp, out, rate = sys.argv[1:4]
rows = {dt: json.load(open(f"{tmp}/{dt}/pushpull.json")) for dt in ("f32", "bf16")}
res = []
print(f"link {rate}: zps GB/s (f32-equivalent), bf16 against f32")
print(f"{'bytes':>9} {'op':<9} {'f32':>7} {'bf16':>7} {'bf16/f32':>8} {'raw f32':>8} {'raw bf16':>8}")
for a, b in zip(rows["f32"], rows["bf16"]):
    if a["bytes"] < 1 << 20 or a["op"] == "pull":
        continue
    gain = b["zps_gbps"] / a["zps_gbps"] if a["zps_gbps"] > 0 else 0
    print(f"{a['bytes']:>9} {a['op']:<9} {a['zps_gbps']:7.3f} {b['zps_gbps']:7.3f} {gain:8.2f} "
          f"{a['raw_gbps']:8.3f} {b['raw_gbps']:8.3f}")
    res.append({"rate": rate, "bytes": a["bytes"], "op": a["op"], "f32_gbps": a["zps_gbps"],
                "bf16_gbps": b["zps_gbps"], "bf16_over_f32": gain, "raw_f32_gbps": a["raw_gbps"],
                "raw_bf16_gbps": b["raw_gbps"], "f32_ratio": a["ratio"], "bf16_ratio": b["ratio"]})
json.dump(res, open(out, "w"), indent=1)
print(f"wrote {out}")
EOF
