#!/usr/bin/env python3
"""Per-kernel time from an Nsight Compute CSV (ncu --csv --metrics gpu__time_duration.sum,
dram__bytes_read.sum): launches, median microseconds and median DRAM read GB/s per kernel
name, so one device run shows where a decode step spends its time without a profiler GUI.

Usage: ncu_summary.py ncu.csv
"""
import csv
import statistics
import sys
from collections import defaultdict


def main():
    rows = []
    with open(sys.argv[1], newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # skip ncu's own log lines
    for r in csv.DictReader(lines):
        rows.append(r)
    by = defaultdict(lambda: defaultdict(list))
    for r in rows:
        name = r.get("Kernel Name", "?")
        unit, val = r.get("Metric Unit", ""), r.get("Metric Value", "").replace(",", "")
        try:
            v = float(val)
        except ValueError:
            continue
        metric = r.get("Metric Name", "")
        if metric == "gpu__time_duration.sum":
            scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit, 1e-3)
            by[name]["us"].append(v * scale)
        elif metric == "dram__bytes_read.sum":
            scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1)
            by[name]["bytes"].append(v * scale)
    print(f"{'kernel':<40} {'launches':>8} {'median us':>10} {'min':>8} {'max':>8} {'MB read':>9} {'GB/s':>7}")
    for name, d in sorted(by.items(), key=lambda x: -statistics.median(x[1]["us"]) if x[1]["us"] else 0):
        if not d["us"]:
            continue
        us = statistics.median(d["us"])
        mb = statistics.median(d["bytes"]) / 1e6 if d["bytes"] else 0
        print(f"{name[:40]:<40} {len(d['us']):>8} {us:>10.1f} {min(d['us']):>8.1f} {max(d['us']):>8.1f} "
              f"{mb:>9.1f} {mb * 1e-3 / (us * 1e-6) if us else 0:>7.0f}")


if __name__ == "__main__":
    sys.exit(main())
