"""The notebooks in notebooks/: executed top to bottom (04_existing_pipeline
twice in one kernel, as a reader re-runs it).

Each notebook runs in a real Jupyter kernel started from this interpreter
(nbclient; ipykernel's "python3" kernelspec launches `sys.executable`, so a
fresh virtualenv with `.[dev]` finds it), with notebooks/ as the working
directory, as a reader would run it. Any cell error fails the test, naming
the cell. The committed copies must carry the outputs of a real run.

Re-execute the notebooks and save their outputs with:

    python -m tests.test_notebooks [notebooks/NAME.ipynb ...]
"""

from __future__ import annotations

import copy
import pathlib
import re
import sys
import time

import nbclient
from nbclient.exceptions import CellExecutionError
import nbformat
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ("01_data_parallel", "02_model_and_pipeline_parallel",
            "03_inference", "04_existing_pipeline", "05_bring_your_own",
            "06_keras_hub_llm")
# Generous: each notebook takes well under a minute on an idle 2-core CPU,
# but CI shares its cores.
CELL_TIMEOUT_S = 600
STARTUP_TIMEOUT_S = 180


def execute(nb: nbformat.NotebookNode, *, runs: int = 1,
            cwd: pathlib.Path = NOTEBOOK_DIR) -> nbformat.NotebookNode:
  """Runs every code cell of `nb`, `runs` times over, in one fresh kernel.

  Outputs are written into `nb` (the last run's).

  Raises:
    nbclient.exceptions.CellExecutionError: a cell raised; the message
      names the cell and the error.
  """
  client = nbclient.NotebookClient(
      nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
      startup_timeout=STARTUP_TIMEOUT_S, record_timing=False,
      resources={"metadata": {"path": str(cwd)}})
  with client.setup_kernel():
    info = client.wait_for_reply(client.kc.kernel_info())
    nb.metadata["language_info"] = info["content"]["language_info"]
    for _ in range(runs):
      client.reset_execution_trackers()
      for index, cell in enumerate(nb.cells):
        client.execute_cell(cell, index,
                            execution_count=client.code_cells_executed + 1)
  return nb


def _code(nb: nbformat.NotebookNode) -> list[str]:
  return [c.source for c in nb.cells if c.cell_type == "code"]


def _shown(cell: nbformat.NotebookNode) -> bool:
  """Whether a code cell displayed a result (not only printed to a stream)."""
  return any(o.output_type in ("execute_result", "display_data")
             for o in cell.outputs)


# ------------------------------------------------------------ fast checks


def test_every_expected_notebook_is_there():
  assert [p.stem for p in NOTEBOOKS] == list(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_holds_a_clean_run(path):
  """Executed in order from a fresh kernel, every cell, no error output."""
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  assert nb.metadata.kernelspec.name == "python3"
  counts = [c.execution_count for c in nb.cells if c.cell_type == "code"]
  assert counts == list(range(1, len(counts) + 1)), (
      f"{path.name} is not a top-to-bottom run: execution counts {counts}. "
      "Re-run: python -m tests.test_notebooks")
  for i, cell in enumerate(nb.cells):
    for out in cell.get("outputs", []):
      assert out.output_type != "error", f"{path.name} cell {i}: {out.ename}"
      text = out.get("text", "")
      assert "Traceback" not in text, f"{path.name} cell {i} printed a traceback"
  assert any(c.get("outputs") for c in nb.cells), f"{path.name} has no outputs"


# One record of TF's C++ logging (`E0000 00:00:1796232341.561932    7305
# cuda_platform.cc:52] failed call to cuInit: ...`), or absl's banner before it.
_TF_CPP_LINE = re.compile(
    r"^([IWEF]\d{4} \d\d:\d\d:[\d.]+ +\d+ [^\s\]]+\.cc:\d+\] |WARNING: All log "
    r"messages before absl::InitializeLog\(\))", re.M)


def test_the_tf_cpp_line_pattern_matches_what_tf_prints():
  for line in (
      "E0000 00:00:1796232341.561932    7305 cuda_platform.cc:52] failed call "
      "to cuInit: INTERNAL: CUDA error",
      "I0000 00:00:1796232338.464956    7305 cudart_stub.cc:31] Could not "
      "find cuda drivers on your machine, GPU will not be used.",
      "W0000 00:00:1796232338.4649 12 port.cc:9] a warning",
      "WARNING: All log messages before absl::InitializeLog() is called are "
      "written to STDERR"):
    assert _TF_CPP_LINE.search("text before\n" + line + "\n"), line
  assert not _TF_CPP_LINE.search("Epoch 1/2: loss 0.3 I0000 is not at the start")
  # tfmgpu's own absl log lines (Python) are output, not TF's C++ noise.
  assert not _TF_CPP_LINE.search(
      "I1204 17:22:16.799051 140675664120704 runs.py:298] Training ...")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_output_holds_tensorflows_cpp_start_up_lines(path):
  """Issue 29 item 11: no `E0000 ... cuInit`, `I0000 ... cudart_stub` or W
  line of TF's C++ logging in any committed output."""
  nb = nbformat.read(path, as_version=4)
  for i, cell in enumerate(nb.cells):
    for out in cell.get("outputs", []):
      found = _TF_CPP_LINE.search(out.get("text", ""))
      assert not found, (
          f"{path.name} cell {i} shows TF's C++ log line "
          f"{found.group(0)!r}...: load TensorFlow with "
          "tfmgpu.quiet_tensorflow() in the first cell and re-run: "
          "python -m tests.test_notebooks " + f"notebooks/{path.name}")
      assert "INFO:tensorflow:" not in out.get("text", ""), (
          f"{path.name} cell {i} shows TF's Python INFO logs: set "
          "tf.get_logger().setLevel('WARNING') after importing TensorFlow.")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_uses_the_library_not_flags(path):
  code = _code(nbformat.read(path, as_version=4))
  first = code[0]
  # TensorFlow loads through tfmgpu's filter, so its C++ start-up lines stay
  # out of the outputs (see the test below).
  assert first.index("tfmgpu.quiet_tensorflow()") < first.index(
      "import tensorflow")
  assert "tfmgpu.configure_devices(logical_cpus=4)" in first
  everything = "\n".join(code)
  assert not re.search(r"absl\.flags|from absl import (app|flags)|FLAGS",
                       everything)


# ------------------------------------------------------- executing them


# Re-run top to bottom in the same kernel: the existing-pipeline notebook,
# whose second pass calls configure_devices again and makes new strategies
# (mirrored, default, one_device, central_storage), models and Keras `fit`
# runs in a process that already ran them (what each notebook's first cell
# promises; the parts are tested in a process that reuses them too:
# test_collective_keys.py, test_devices.py, test_generation.py). It is the
# cheapest notebook that rebuilds strategies; the others run once: a second
# pass costs 80% of the first.
RUN_TWICE = ("04_existing_pipeline",)


def check_runs(path: pathlib.Path, cwd: pathlib.Path = NOTEBOOK_DIR,
               runs: int = 1):
  """Top to bottom from a fresh kernel, then (`runs=2`) all over again in
  that kernel."""
  committed = nbformat.read(path, as_version=4)
  nb = execute(copy.deepcopy(committed), runs=runs, cwd=cwd)
  # Every run shows its results (tables, pictures) as the committed one.
  for i, (before, after) in enumerate(zip(committed.cells, nb.cells)):
    if before.cell_type == "code" and _shown(before) and not _shown(after):
      pytest.fail(f"{path.name} cell {i} showed nothing on run {runs}.")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
  check_runs(path, runs=2 if path.stem in RUN_TWICE else 1)


@pytest.mark.slow
def test_the_kernel_runs_this_interpreter(tmp_path):
  """So a fresh virtualenv tests its own install, not another Python's."""
  nb = nbformat.v4.new_notebook(
      cells=[nbformat.v4.new_code_cell("import sys\nprint(sys.prefix)")])
  execute(nb, cwd=tmp_path)
  assert nb.cells[0].outputs[0].text.strip() == sys.prefix


@pytest.mark.slow
def test_the_second_run_shares_the_kernel_of_the_first(tmp_path):
  """A notebook that only breaks when re-run in the same kernel fails."""
  nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
      "assert 'seen' not in globals(), 'state left by the first run'\n"
      "seen = True")])
  execute(copy.deepcopy(nb), cwd=tmp_path)
  with pytest.raises(CellExecutionError, match="state left by the first run"):
    execute(nb, runs=2, cwd=tmp_path)


@pytest.mark.slow
def test_a_failing_cell_fails_the_run(tmp_path):
  """A broken copy of a real notebook fails the check the notebooks go through.

  Its first code cell is the broken one, so the kernel fails before it loads
  TensorFlow (a later cell fails the same way: nbclient stops at any error).
  """
  broken = nbformat.read(NOTEBOOKS[0], as_version=4)  # Needs no files.
  code_cells = [c for c in broken.cells if c.cell_type == "code"]
  code_cells[0].source = "raise ValueError('deliberately broken cell')"
  path = tmp_path / "broken.ipynb"
  nbformat.write(broken, path)
  with pytest.raises(CellExecutionError, match="deliberately broken cell"):
    check_runs(path, cwd=tmp_path)


def _regenerate(paths: list[pathlib.Path]) -> None:
  for path in paths:
    start = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
      if cell.cell_type == "code":
        cell.outputs, cell.execution_count = [], None
    execute(nb)
    nbformat.write(nb, path)
    print(f"{path.name}: executed in {time.perf_counter() - start:.1f} s",
          flush=True)


if __name__ == "__main__":
  _regenerate([pathlib.Path(p) for p in sys.argv[1:]] or NOTEBOOKS)
