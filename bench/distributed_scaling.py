"""The arithmetic of docs/distributed_release_scaling.md: the sharded release's runs of
bench/test_bench_distributed_release.py carried to 8 GPUs on 2 nodes.

    python bench/distributed_scaling.py bench/results/bench_distributed_release-cpu-DATE.json

prints the Markdown tables of the doc: (1) the measured per-rank figures of the
recorded run and the memory model checked against them, (2) per GPU of W = 8 for
the issue's two configurations: memory, bytes into and sent by the reduce-scatter,
the times these take at the stated link bandwidths, the HBM bound of the sums, and
the accounting, timed here (rank 0 does it once, on a CPU, whatever W).
Assumed bandwidths (nominal, per direction; stated in the doc): HBM 3.35 TB/s,
NVLink 450 GB/s per GPU, NDR InfiniBand 400 Gb/s (50 GB/s) per GPU, or one 100 Gb/s
(12.5 GB/s) Ethernet link per node.
"""
from __future__ import annotations

import json
import sys
import time

CHUNK = 1 << 25                 # release_sharded's default chunk_bytes
HBM, NVLINK, IB_GPU, ETH_NODE = 3.35e12, 450e9, 50e9, 12.5e9
MB = 2**20


def memory(n, T, d, K, W, item=4):
    """Bytes per rank of release_sharded (docs/architecture.md, "Across ranks")."""
    b = max(1, min(-(-T // W), CHUNK // (W * d * item)))
    return dict(shard=n / W * d * item, outputs=T / W * (d + K) * item,
                labels=2 * n * 8 + n / W * 8,
                rounds=W * b * d * item + b * d * item + b * (d + K) * 8 + W * b * K * 8, b=b)


def measured_table(rows):
    out = ["| configuration | ranks | threads / rank | release s | shard MB | RSS growth MB "
           "(measured) | model: outputs + buffers MB | reduce-scatter input MB (model T·d·4) "
           "| socket bytes written MB (measured) | multiply-adds / s / thread (rounds minus "
           "reduce-scatter) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            continue
        n, T, d, K, m, W = r["n"], r["T"], r["d"], r["K"], r["m"], r["ranks"]
        mm = memory(n, T, d, K, W)
        rate = T * m * d / (r["compute_s"] * W * r["threads"])
        out.append(f"| {r['config']} | {W} | {r['threads']} | {r['release_s']:.2f} | "
                   f"{r['shard_mb']:.0f} | {r['extra_mb']:.0f} | "
                   f"{(mm['outputs'] + mm['rounds']) / MB:.0f} | "
                   f"{r['rs_mb']:.0f} ({T * d * 4 / MB:.0f}) | {r['written_mb']:.0f} | "
                   f"{rate:.3g} |")
    return "\n".join(out)


def accounting_s(n):
    from ncdp_fast.release import NeuroMixGDP
    t0 = time.perf_counter()
    NeuroMixGDP(epsilon=1.0, delta=1e-5, mixup_degree=64, num_samples=n).noise(n, 10)
    return time.perf_counter() - t0


def gpu_table(rate, W=8):
    out = ["| configuration (W = 8: 2 nodes x 4 GPUs) | shard MB / GPU | outputs MB / GPU | "
           "labels + round buffers MB / GPU | reduce-scatter input MB / GPU | ring sends MB / GPU "
           "| reduce-scatter ms, one ring, 400 Gb/s IB | ms, one ring, 100 GbE | sums ms, HBM bound "
           "| sums s, 1 CPU thread / rank at the measured rate | save: rank 0 receives MB, ms over IB "
           "| accounting s (rank 0, measured here) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, d in ((60000, 3969), (1_000_000, 512)):
        T, K, m = n, 10, 64
        mm = memory(n, T, d, K, W)
        N = T * d * 4
        send = (W - 1) / W * N
        # One ring over 2 nodes crosses the node boundary twice (once each way); each
        # crossing carries the ring's whole stream, so that link sets the pace.  NCCL
        # with one NIC per GPU can run 4 rings at once (up to 4x faster): not counted.
        t_ib = send / min(IB_GPU, NVLINK)
        t_eth = send / ETH_NODE
        hbm = T * m * d * 4 / W / HBM
        cpu = T * m * d / W / rate
        save = (W - 1) / W * T * (d + K) * 4
        save_ib = (T * (d + K) * 4 / 2) / IB_GPU       # the other node's half over one NIC
        out.append(f"| n = T = {n}, d = {d}, K = {K}, m = {m}, Poisson | "
                   f"{mm['shard'] / MB:.0f} | {mm['outputs'] / MB:.0f} | "
                   f"{(mm['labels'] + mm['rounds']) / MB:.0f} | {N / MB:.0f} | {send / MB:.0f} | "
                   f"{1e3 * t_ib:.0f} | {1e3 * t_eth:.0f} | {1e3 * hbm:.1f} | {cpu:.1f} | "
                   f"{save / MB:.0f}, {1e3 * save_ib:.0f} | {accounting_s(n):.1f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    doc = json.loads(open(argv[0]).read())
    rows, meta = doc["rows"], doc["meta"]
    print(f"Measured: {meta['device']}, commit {meta['commit']}, {meta['date']}, size "
          f"{meta['size']}, {meta['rounds']} round(s).\n")
    print(measured_table(rows) + "\n")
    two = [r for r in rows if r.get("ranks") == 2 and not r.get("error")]
    best = max(two, key=lambda r: r["T"] * r["m"] * r["d"])      # the largest measured run
    rate = best["T"] * best["m"] * best["d"] / (best["compute_s"] * 2 * best["threads"])
    print(f"Rate used below: {rate:.3g} multiply-adds / s / thread ({best['config']}, 2 ranks; "
          f"the rounds without the time inside reduce-scatters: sampling, clipping, sums, "
          f"noise).\n")
    print(gpu_table(rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
