"""Peak memory of `tfmgpu.predict` on a large input, against its bound.

The promise (issue #13): predicting N rows holds the input, at most 1.5x
the output and a constant besides, with no whole-input copies. This script
measures it in a fresh process per case: it builds the model, warms the
predictor up on a few rows, makes the input, reads the peak resident memory
(`VmHWM`), predicts every row into a `.npy` file and reads the peak again.
The growth is what prediction held on top of the input and the warm
process; it must stay under 1.5x the output plus a constant.

Usage:
  python scripts/predict_memory.py [--rows=200000] [--strategy=default]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CONSTANT_MIB = 64  # tf.data buffers, prefetched batches, chunks in flight.

_CHILD = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np
import tfmgpu
from tfmgpu import data, inference, models

def peak_mib():
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024

rows, strategy, devices, out = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
from tfmgpu import devices as devices_lib
devices_lib.configure_virtual_devices(devices)
digits = data.load_dataset("digits")
model = models.build_model("mlp", input_shape=digits.input_shape,
                           num_classes=digits.num_classes, seed=0)
predictor = inference.Predictor(model, strategy=strategy, batch_size=1024)
predictor.predict(digits.x_test[:2048])  # Traced and warm.
x = np.resize(digits.x_train, (rows, *digits.x_train.shape[1:]))
before = peak_mib()
predictions = predictor.predict(x)
inference.save_predictions(out, predictions)
after = peak_mib()
print(json.dumps({"rows": rows, "input_mib": x.nbytes / 2**20,
                  "output_mib": predictions.nbytes / 2**20,
                  "peak_before_mib": before, "peak_after_mib": after}))
"""


def measure(rows: int, strategy: str, devices: int) -> dict:
  """One fresh process's figures (see the module docstring)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "predictions.npy")
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(rows), strategy, str(devices), out],
        capture_output=True, text=True, check=False, timeout=1800)
  if result.returncode:
    raise SystemExit(f"error: the measuring process failed:\n"
                     f"{result.stderr[-3000:]}")
  figures = json.loads(result.stdout.strip().splitlines()[-1])
  figures["growth_mib"] = figures["peak_after_mib"] - figures["peak_before_mib"]
  figures["bound_mib"] = 1.5 * figures["output_mib"] + CONSTANT_MIB
  figures["strategy"] = strategy
  return figures


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=200_000)
  parser.add_argument("--strategy", action="append",
                      help="default, mirrored, ... (repeatable; default: "
                      "default and mirrored)")
  parser.add_argument("--devices", type=int, default=2,
                      help="logical CPUs for mirrored")
  args = parser.parse_args(argv)
  ok = True
  print(f"{'strategy':<10} {'rows':>8} {'input MiB':>10} {'output MiB':>11} "
        f"{'growth MiB':>11} {'bound MiB':>10}  holds")
  for strategy in args.strategy or ["default", "mirrored"]:
    f = measure(args.rows, strategy, args.devices)
    holds = f["growth_mib"] <= f["bound_mib"]
    ok &= holds
    print(f"{strategy:<10} {f['rows']:>8} {f['input_mib']:>10.0f} "
          f"{f['output_mib']:>11.1f} {f['growth_mib']:>11.1f} "
          f"{f['bound_mib']:>10.1f}  {'yes' if holds else 'NO'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
