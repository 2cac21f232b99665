"""`fastddrive eval` under `accelerate launch --multi_gpu --num_processes 2` (two gloo processes on this CPU): each
process a share of the split, the merged per-sample results equal to one process's, a sample that does not read
reported once with its shard, the table printed once."""

import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from fastddrive.core.outputs import finite
from fastddrive.data.build import build_dataset
from fastddrive.data.dataset import MANIFEST, DrivingDataset, shard_record
from fastddrive.eval.accuracy import evaluate_split
from fastddrive.serve.loadtest import free_port


def _damage_history(data, index):
    """Give test sample `index` a NaN history past the sample checks (the manifest's record kept in step, as a
    faulty writer would); its shard and id."""
    manifest = json.loads((data / MANIFEST).read_text())
    shard = next(s for s in sorted(manifest["shards"]) if s.startswith("test/"))
    table = pq.read_table(data / shard)
    rows = table.to_pylist()
    rows[index]["history"] = [float("nan")] * len(rows[index]["history"])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), sink)
    raw = sink.getvalue().to_pybytes()
    (data / shard).write_bytes(raw)
    manifest["shards"][shard] = shard_record(raw, len(rows))
    (data / MANIFEST).write_text(json.dumps(manifest))
    return shard, rows[index]["sample_id"]


def test_two_processes_give_the_per_sample_results_of_one(tmp_path, embedded):
    data = tmp_path / "data"
    build_dataset(data, 2, 5, ["merge"])
    shard, bad = _damage_history(data, 1)  # in the first process's share
    out = tmp_path / "two.json"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port())]
    command = ["-m", "fastddrive.cli", "eval", "--data", str(data), "--limit", "3", "--decoders", "ss"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, *command, "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-4000:]  # a sample failed: the run says so
    assert done.stdout.count("constant velocity") == 1  # one table, from the main process
    assert done.stderr.count(f"{shard} sample {bad}: history holds NaN") == 1  # reported once
    assert not re.search(r'File ".*fastddrive/', done.stderr)  # no traceback of ours (the launcher prints its own)
    two = json.loads(out.read_text())["decoders"]["ss"]

    one = evaluate_split(embedded, DrivingDataset.open(data), "test", {"ss": ("ss", {})}, limit=3)["ss"]
    assert len(one.per_sample) == 3  # shared 2 + 1 between the processes
    assert two["per_sample"] == json.loads(json.dumps(finite(one.per_sample)))
    assert two["ade5_m"] == one.ade5_m and two["samples"] == one.samples == 3
    assert two["failures"] == one.failures == [f"{shard} sample {bad}: history holds NaN or infinite values"]
