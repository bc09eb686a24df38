"""Benchmarks: side-by-side timings against baselines run in the same process.

Modules, primitives first, then the suite built from them:
  training: training throughput of one model, data, strategy and batch
    through tfmgpu's loop, Keras `fit` (with and without `FusedAdam`), TF's
    tutorial loop and a bare single-device floor.
  inference: `tfmgpu.predict` against Keras `predict`, and predictor options.
  ceiling: float32 matmul throughput and the fraction of it training reaches.
  projection: a projected (not measured) data-parallel step on N GPUs from
    gradient bytes and link bandwidth, and a hybrid layout's step on a named
    GPU host by the cost model.
  orbit: tfmgpu's loop on a shuffled `tf.data` input against Keras `fit`
    and TF Model Garden's Orbit (when installed).
  language_model: `gpt` tokens/s per layout against Keras `fit`.
  hybrid: `gpt` tokens/s of data x pipeline x tensor layouts against data
    parallelism on as many devices.
  pipeline: per-stage forward/backward times of a staged or pipelined model
    and the activation bytes each stage keeps for its backward.
  pipeline_overlap: a K-stage pipeline with M micro-batches against M=1,
    measured beside the simulator (`scripts/bench_pipeline.py`).
  options: `SuiteOptions`, what a suite run measures.
  report: a suite run's rows, headline figures and CSV.
  sections: the suite's sections, each timing its paths and printing a table.
  plots: the suite's figures.
  suite: `run_suite`, behind `python -m tfmgpu.bench`.
  compare: two suite runs' CSVs side by side (`python -m tfmgpu.bench
    --compare A.csv B.csv`).

Importing this package does not import TensorFlow; its modules that time
something do (`options`, `report` and `compare` do not).
"""
