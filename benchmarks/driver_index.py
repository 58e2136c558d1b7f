"""python benchmarks/driver_index.py [--quick]

The driver's data index at scale: what `ParquetSource.index` costs when the data set is 10,000 Parquet files of
10 row groups each (100,000 row groups), and what each worker then does with it.

The script writes the files (an int64 id, 8 float32 features as a fixed-size list, a float32 target; 4 rows per
row group: the footers are what is read here, not the rows) to a temporary directory on local disk, then, in a
fresh Python process that has already imported raytrain and pyarrow (so the figures are the index's own):
    driver_index_s            wall time of `ParquetSource(dir).index(("x", "y"), "id")`: listing the files and
                              reading every footer (FOOTER_THREADS at a time);
    driver_index_rss_bytes    the process's peak RSS over that call less its RSS before (the peak is reset first
                              through /proc/self/clear_refs; real memory, pyarrow's included);
    index_pickle_bytes        the pickled index, what the driver ships to each worker;
    order_build_s             one epoch's order on a worker (`PartitionedOrder` over the 100,000 row groups);
    step_items_ms             one step's layout in that order (global batch 1024).
Goals (issue 29): driver_index_s <= 30 and driver_index_rss_bytes <= 1 GB. On object storage each footer is a
round trip (tens of ms), which the threads overlap; a local disk shows the CPU cost. `--quick`: 1,000 files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import machine_line, print_headline

ROW_GROUPS_PER_FILE, ROWS_PER_GROUP, FEATURES = 10, 4, 8

MEASURE = r"""
import json, pickle, sys, time
import numpy as np
import pyarrow.parquet  # noqa: F401  (imported before the measurement)
from raytrain.data.parquet import ParquetSource

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

directory = sys.argv[1]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
before = status("VmRSS")
began = time.perf_counter()
index = ParquetSource(directory).index(("x", "y"), "id")
seconds = time.perf_counter() - began
peak = status("VmHWM")
shipped = len(pickle.dumps(index))
began = time.perf_counter()
order = index.order(seed=0, epoch=0)
order_s = time.perf_counter() - began
began = time.perf_counter()
for begin in range(0, 20 * 1024, 1024):
    order.step_items(begin, begin + 1024)
items_ms = (time.perf_counter() - began) / 20 * 1000
print(json.dumps({
    "files": len(index.files), "row_groups": len(index.chunk_rows), "rows": index.num_rows,
    "partitions": index.partitions, "seconds": seconds, "rss_growth": peak - before,
    "pickle_bytes": shipped, "order_s": order_s, "items_ms": items_ms,
}))
"""


def write_files(directory: str, files: int) -> float:
    """`files` Parquet files of ROW_GROUPS_PER_FILE row groups; returns the seconds it took."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    began = time.perf_counter()
    rows = ROW_GROUPS_PER_FILE * ROWS_PER_GROUP
    rng = np.random.default_rng(0)
    for number in range(files):
        ids = np.arange(number * rows, (number + 1) * rows, dtype=np.int64)
        x = pa.FixedSizeListArray.from_arrays(
            pa.array(rng.standard_normal(rows * FEATURES, dtype=np.float32)), FEATURES
        )
        table = pa.table({"id": ids, "x": x, "y": pa.array(rng.standard_normal(rows, dtype=np.float32))})
        pq.write_table(table, os.path.join(directory, f"part-{number:05d}.parquet"), row_group_size=ROWS_PER_GROUP)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 files instead of 10,000 (a smoke run)")
    args = parser.parse_args()
    files = 1_000 if args.quick else 10_000
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-index-") as directory:
        written = write_files(directory, files)
        print(f"wrote {files} files of {ROW_GROUPS_PER_FILE} row groups in {written:.1f} s", flush=True)
        out = subprocess.run(
            [sys.executable, "-c", MEASURE, directory], check=True, capture_output=True, text=True
        ).stdout
    found = json.loads(out.strip().splitlines()[-1])
    print(machine_line())
    print(
        f"\nDriver index: {found['files']:,} files, {found['row_groups']:,} row groups, {found['rows']:,} rows, "
        f"{found['partitions']} partitions\n"
        f"  index (list + footers): {found['seconds']:.2f} s, peak RSS growth {found['rss_growth'] / 1e6:.1f} MB; "
        f"shipped to each worker: {found['pickle_bytes'] / 1e6:.2f} MB pickled\n"
        f"  on a worker: an epoch's order in {found['order_s']:.3f} s, a step's layout (B = 1024) in "
        f"{found['items_ms']:.2f} ms\n"
        f"goals: index <= 30 s and <= 1 GB"
    )
    print_headline(
        {
            "driver_index_s": round(found["seconds"], 3),
            "driver_index_rss_bytes": found["rss_growth"],
            "driver_index_row_groups": found["row_groups"],
            "index_pickle_bytes": found["pickle_bytes"],
            "order_build_s": round(found["order_s"], 4),
            "step_items_ms": round(found["items_ms"], 3),
        }
    )


if __name__ == "__main__":
    main()
