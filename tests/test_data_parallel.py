"""`fastddrive eval` under `accelerate launch --cpu --num_processes 2`: each process a share of the split, the
merged per-sample results equal to one process's, the table printed once."""

import json
import os
import subprocess
import sys

from fastddrive.data.build import build_dataset
from fastddrive.data.sample import DrivingDataset
from fastddrive.eval.accuracy import evaluate_split
from fastddrive.outputs import finite
from fastddrive.serve.loadtest import free_port


def test_two_processes_give_the_per_sample_results_of_one(tmp_path, embedded):
    data = tmp_path / "data"
    build_dataset(data, 2, 5, ["merge"])
    out = tmp_path / "two.json"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port())]
    command = ["-m", "fastddrive.cli", "eval", "--data", str(data), "--limit", "3", "--decoders", "ss"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, *command, "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("constant velocity") == 1  # one table, from the main process
    two = json.loads(out.read_text())["decoders"]["ss"]

    one = evaluate_split(embedded, DrivingDataset.open(data), "test", {"ss": ("ss", {})}, limit=3)["ss"]
    assert len(one.per_sample) == 3  # shared 2 + 1 between the processes
    assert two["per_sample"] == json.loads(json.dumps(finite(one.per_sample)))
    assert two["ade5_m"] == one.ade5_m and two["samples"] == one.samples == 3
