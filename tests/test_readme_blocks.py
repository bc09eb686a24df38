"""Every block and every command of README.md is run, so the guide cannot drift.

Python blocks run as-is (below). Every other fenced block and every command
(in `bash` and plain blocks, and inline in the text) is either run cheaply
(`--help`, `--plan_only`, a step or two) by `test_readme_command_runs`, or
listed in `COMMANDS` / `OTHER_BLOCKS` with the reason it is not; a new
block or command that is in neither fails `test_every_block_and_command_is_
run_or_listed`. No command's output may hold a line of TF's C++ logging.


Each block runs as in a fresh interpreter, in a directory and a namespace of
its own: a block defines every name it uses, and one that needs logical
devices configures them itself. Blocks that split the CPU alike share one
interpreter (TensorFlow imported once), one after another, with Keras'
session cleared between them. A block that cannot run on one CPU
machine (a multi-worker cluster, a TPU) carries, on the line right before its
fence, `<!-- illustrative: WHY -->`; it is listed and skipped, and must say why.
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
README = os.path.join(ROOT, "README.md")

# A fence opening a Python block, the line before it, and the block's code.
_BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)^```[ \t]*$",
                    re.S | re.M)
# A plain fence right after a block (blank lines between): what it prints.
_SHOWN = re.compile(r"\A\s*```\n(?P<shown>.*?)^```[ \t]*$", re.S | re.M)
_ILLUSTRATIVE = re.compile(r"^<!--\s*illustrative:(?P<why>.*?)-->\s*$")
_TIMEOUT_S = 240


def readme_blocks(text: str) -> list[dict]:
  """The README's ```python blocks in order.

  Each is a dict: `line` (of the fence), `code`, `illustrative` (the reason,
  or None) and `shown` (the output printed right after it, or None).
  """
  blocks = []
  for match in _BLOCK.finditer("\n" + text):
    mark = _ILLUSTRATIVE.match(match["before"].strip())
    shown = _SHOWN.match(("\n" + text)[match.end() + 1:])
    blocks.append({
        # Newlines before the code, less the one prepended: the fence's line.
        "line": ("\n" + text)[:match.start("code")].count("\n") - 1,
        "code": match["code"],
        "illustrative": mark["why"].strip() if mark else None,
        "shown": shown["shown"] if shown else None,
    })
  return blocks


BLOCKS = readme_blocks(open(README).read())
RUNNABLE = [b for b in BLOCKS if b["illustrative"] is None]


def test_blocks_are_found_and_illustrative_ones_say_why():
  """The parser sees every block; skipped blocks give a reason."""
  fences = open(README).read().count("```python\n")
  assert len(BLOCKS) == fences and len(RUNNABLE) >= 5, (len(BLOCKS), fences)
  illustrative = [(b["line"], b["illustrative"]) for b in BLOCKS
                  if b["illustrative"] is not None]
  print("illustrative README blocks (line, why):", illustrative)
  for line, why in illustrative:
    assert len(why.split()) >= 3, (
        f"README.md:{line}: an illustrative block must say why it cannot run "
        f"on one CPU machine, got {why!r}")


def test_the_parser_reads_marks_and_code():
  text = ("intro\n```python\nprint(1)\n```\n\n```\n1\n```\n"
          "<!-- illustrative: needs a TPU slice -->\n```python\ntpu()\n```\n"
          "```bash\nls\n```\n")
  blocks = readme_blocks(text)
  assert [b["code"] for b in blocks] == ["print(1)\n", "tpu()\n"]
  assert [b["illustrative"] for b in blocks] == [None, "needs a TPU slice"]
  assert [b["line"] for b in blocks] == [2, 10]
  assert [b["shown"] for b in blocks] == ["1\n", None]


def _block_groups(blocks: list[dict]) -> list[list[dict]]:
  """`blocks` by the logical CPUs they split the machine into (none, 2,
  4, ...): a process can split its devices once, so each group runs in one
  interpreter of its own (`_BLOCKS_IN_ONE_PROCESS`)."""
  groups: dict[str, list[dict]] = {}
  for block in blocks:
    cpus = re.search(r"logical_cpus=(\d+)", block["code"])
    groups.setdefault(cpus[1] if cpus else "", []).append(block)
  return list(groups.values())


BLOCK_GROUPS = _block_groups(RUNNABLE)

# Runs each block of `sys.argv[1]` (JSON) as a fresh interpreter would, one
# after another: in a directory of its own, in a namespace of its own, with
# Keras' session cleared; a line `_MARK` before each output.
_MARK = "@@ README block @@"
_BLOCKS_IN_ONE_PROCESS = f"""
import json, os, sys
for i, code in enumerate(json.loads(sys.argv[1])):
  if "keras" in sys.modules:
    sys.modules["keras"].backend.clear_session()
  print({_MARK!r}, flush=True)
  print({_MARK!r}, file=sys.stderr, flush=True)
  os.makedirs(f"block{{i}}")
  os.chdir(f"block{{i}}")
  exec(compile(code, f"README block {{i}}", "exec"), {{"__name__": "__main__"}})
  os.chdir("..")
  sys.stdout.flush()
  sys.stderr.flush()
"""


@pytest.mark.slow
@pytest.mark.parametrize("group", BLOCK_GROUPS, ids=[
    "+".join(f"line{b['line']}" for b in g) for g in BLOCK_GROUPS])
def test_readme_block_runs(group, tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("TF_CONFIG", None)
  out = subprocess.run(
      [sys.executable, "-c", _BLOCKS_IN_ONE_PROCESS,
       json.dumps([b["code"] for b in group])], cwd=tmp_path, env=env,
      capture_output=True, text=True, timeout=_TIMEOUT_S * len(group))
  printed = out.stdout.split(_MARK + "\n")[1:]
  errors = out.stderr.split(_MARK + "\n")[1:]
  for index, block in enumerate(group):
    stdout = printed[index] if index < len(printed) else ""
    stderr = errors[index] if index < len(errors) else ""
    last = index == len(printed) - 1
    assert index < len(printed) - 1 or (last and out.returncode == 0), (
        f"README.md block at line {block['line']} exited {out.returncode}:\n"
        f"{block['code']}\n--- stdout ---\n{stdout[-4000:]}\n"
        f"--- stderr ---\n{stderr[-6000:]}")
    # Keras warns when fit's shuffle=True meets a dataset it cannot shuffle.
    assert "`shuffle=True` was passed" not in stderr, (
        f"README.md block at line {block['line']} makes Keras warn:\n"
        f"{stderr[-3000:]}")
    if block["shown"] is not None:
      lines = [line.rstrip() for line in stdout.splitlines()]
      shown = [line.rstrip() for line in block["shown"].splitlines()]
      assert any(lines[i:i + len(shown)] == shown
                 for i in range(len(lines))), (
          f"README.md block at line {block['line']} no longer prints the "
          f"output shown after it:\n{block['shown']}\n--- it printed ---\n"
          f"{stdout}")


# ------------------------------------------------- every block, every command

_FENCE = re.compile(r"^```(?P<lang>\S*)[ \t]*\n(?P<body>.*?)^```[ \t]*$",
                    re.S | re.M)
# A command as the README writes it, inline in the text.
_INLINE = re.compile(
    r"`((?:python3?|bash|ruff|srun|tensorboard|pip) [^`]+)`")
# One record of TF's C++ logging, or absl's banner before the first one.
_TF_CPP_LINE = re.compile(
    r"^([IWEF]\d{4} \d\d:\d\d:[\d.]+ +\d+ [^\s\]]+\.cc:\d+\] |WARNING: All log "
    r"messages before absl::InitializeLog\(\))", re.M)
_TINY = "--epochs=1 --steps_per_epoch=2"
_PROGRAMS = ("python ", "python3 ", "srun ", "bash ", "ruff ", "tensorboard ")
_REFERENCE_BEGIN = "<!-- cli-reference:begin"
_REFERENCE_END = "<!-- cli-reference:end"

# How each command is checked: ("run", extra args appended) runs it (the
# extra args make it cheap), ("help",) runs its program with only --help,
# ("not run", why) says why it is not run here.
COMMANDS = {
    # Quick start.
    "python3 -m pip install .": ("not run", "installs the checkout: .ci/run "
                                 "and the fresh-venv check of #29 item 17 do"),
    "python3 -m tfmgpu.train --strategy=mirrored": ("run", _TINY),
    "python3 -m tfmgpu.doctor": ("run", ""),
    "pip install \".[plots]\"": ("not run", "installs an extra into the "
                                  "environment; .ci/run installs .[dev]"),
    # What it does: --strategy=auto plans.
    "python -m tfmgpu.train --model=gpt --strategy=auto --virtual_devices=8 "
    "--plan_only": ("run", ""),
    "python -m tfmgpu.train --model=gpt --model_size=gpt2_small "
    "--strategy=auto --virtual_devices=8 --device_memory_gb=40 "
    "--link=nvlink_a100 --plan_only": ("run", ""),
    "python -m tfmgpu.train --strategy=model_parallel --num_stages=4 "
    "--model=deep_mlp --virtual_devices=4 --partition=params --plan_only":
        ("run", ""),
    "python -m tfmgpu.train --model=gpt --model_size=gpt2_small "
    "--strategy=pipeline --num_stages=8 --plan_only": ("run", ""),
    # Your own model and data.
    "python -m tfmgpu.train --model=scripts/examples/two_input.py:build "
    "--dataset=scripts/examples/two_input.py:load --strategy=mirrored "
    "--virtual_devices=2": ("run", _TINY),
    "python -m tfmgpu.predict --model_path=runs/<that run>/model.keras "
    "--dataset=scripts/examples/two_input.py:load --strategy=mirrored "
    "--virtual_devices=2": ("not run", "<that run> stands for the run "
                            "directory the command above printed"),
    # Multi-worker training.
    "python -m tfmgpu.launch --num_workers=2 -- python -m tfmgpu.train "
    "--strategy=multi_worker_mirrored --model_dir=runs/mw":
        ("not run", "starts a 2-process cluster; tests/test_launcher.py "
         "and tests/cluster/ run the launcher and multi-worker training"),
    "python -m tfmgpu.train --strategy=multi_worker_mirrored "
    "--model_dir=/shared/runs/mw": ("not run", "one of two hosts at "
                                    "10.0.0.1-2 named by TF_CONFIG"),
    "srun --nodes=2 --ntasks-per-node=1 python -m tfmgpu.train "
    "--strategy=multi_worker_mirrored --cluster_resolver=slurm "
    "--model_dir=/shared/runs/mw": ("not run", "needs a SLURM allocation "
                                    "of two nodes"),
    "python -m tfmgpu.launch --num_workers=2 --num_ps=1 --coordinator -- "
    "python -m tfmgpu.train --strategy=parameter_server --model_dir=runs/ps":
        ("not run", "starts a 4-process parameter-server cluster; "
         "tests/cluster/ runs one"),
    # TFRecord files.
    "python scripts/write_tfrecords.py --dataset=digits "
    "--output_dir=data/digits --num_shards=8": ("run", ""),
    "python -m tfmgpu.train --dataset=tfrecord "
    "--data_path='data/digits/*.tfrecord' --strategy=mirrored "
    "--virtual_devices=2 --epochs=5": ("run", ""),  # As written: 5 epochs,
    # checked by `_check_tfrecord_run` (tests/test_tfrecord.py has no CLI run).
    # The language model.
    "python -m tfmgpu.train --model=gpt --dataset=stdlib_text "
    "--strategy=pipeline --num_stages=4 --micro_batches=8 "
    "--virtual_devices=4": ("run", "--plan_only"),
    "python -m tfmgpu.train --model=gpt --strategy=mirrored "
    "--virtual_devices=2 --model_dir=runs/gpt": ("run", "--epochs=1 "
                                                 "--steps_per_epoch=1"),
    "python -m tfmgpu.generate --model_path=runs/gpt/model.keras "
    "--prompt=\"import \" --sampler=top_k --top_k=5 --temperature=0.8 "
    "--sample_seed=0": ("run", "--max_new_tokens=4"),
    # Hybrid parallelism.
    "python -m tfmgpu.train --model=gpt --strategy=pipeline --data_parallel=2 "
    "--num_stages=2 --tensor_parallel=2 --virtual_devices=8 --plan_only":
        ("run", ""),
    "python -m tfmgpu.train --model=gpt --strategy=pipeline --data_parallel=2 "
    "--num_stages=2 --tensor_parallel=2 --virtual_devices=8":
        ("run", "--plan_only"),
    "python -m tfmgpu.train --model=gpt --strategy=tensor_parallel "
    "--tensor_parallel=2 --data_parallel=2 --virtual_devices=4":
        ("run", "--plan_only"),
    "python -m tfmgpu.train --strategy=mirrored --virtual_devices=2 "
    "--epochs=5": ("run", _TINY),
    "python -m tfmgpu.train --strategy=pipeline --num_stages=1 "
    "--micro_batches=4 --schedule=1f1b --data_parallel=2 "
    "--virtual_devices=2": ("run", _TINY),
    # Programs named in the text: each must exist and print its --help.
    "python -m tfmgpu.train": ("help",),
    "python -m tfmgpu.predict": ("help",),
    "python -m tfmgpu.generate": ("help",),
    "python -m tfmgpu.doctor": ("help",),
    "python -m tfmgpu.launch": ("help",),
    "python -m tfmgpu.bench": ("help",),
    "python -m tfmgpu.bench --quick": ("help",),  # Minutes: test_benchmark.
    "python -m tfmgpu.bench --sections=latency": ("help",),
    "python -m tfmgpu.bench --sections=zero": ("help",),
    "python -m tfmgpu.bench --sections=generate --replicas=1": ("help",),
    "python -m tfmgpu.predict --output=p.npy": ("help",),
    "python -m tfmgpu.predict --model_path=runs/X/model.keras": ("help",),
    "python scripts/predict_memory.py": ("help",),
    "python scripts/bench_pipeline.py": ("help",),
    "python scripts/bench_generate.py": ("help",),
    "python scripts/launch_local_cluster.py": ("help",),
    # Development.
    "python3 -m pip install \".[dev]\"": ("not run", "installs the "
                                          "checkout with its dev extras: "
                                          ".ci/run does"),
    "python3 -m pytest -q -n 2 --dist loadfile": ("not run", "the whole "
                                                  "suite: this is CI"),
    "python3 -m pytest -q tests/test_x.py": ("not run", "tests/test_x.py "
                                             "stands for any test file"),
    "python -m tests.test_notebooks notebooks/X.ipynb": (
        "not run", "re-executes notebooks; tests/test_notebooks.py runs "
        "them"),
    # What the install and the suite take: the measured installs.
    "python3 -m venv": ("not run", "names the tool of the measurement, "
                        "not a command line to copy"),
    "pip install .": ("not run", "the measured core install into a new "
                      "virtualenv; .ci/run makes one too"),
    "pip install \".[dev]\"": ("not run", "the measured dev install; "
                              ".ci/run runs it"),
    "bash .ci/run": ("not run", "builds a virtualenv and runs the whole "
                     "suite"),
    "ruff check tfmgpu tests": ("not run", "tests/test_lint.py runs it"),
    "python scripts/update_cli_reference.py": (
        "not run", "rewrites README.md; tests/test_docs.py checks the "
        "reference is current"),
}

# Fenced blocks other than Python ones and command blocks: what they are.
OTHER_BLOCKS = {
    "strategy               mirrored": "the summary of a full run of the "
                                       "command above it (measured figures)",
    "test loss / bits_per_byte / perplexity / accuracy": (
        "the end of a full gpt run's summary (measured figures)"),
    "import to sing in ment inst inerstare": (
        "text sampled by a fully trained gpt (the run above, not its "
        "one-step stand-in)"),
}


def fenced_blocks(text: str) -> list[dict]:
  """Every fenced block: `line` (of its fence), `lang`, `body`, and
  `follows` (True when only blank lines separate it from the block before)."""
  blocks, end = [], None
  for match in _FENCE.finditer(text):
    between = text[end:match.start()] if end is not None else "x"
    blocks.append({"line": text[:match.start()].count("\n") + 1,
                   "lang": match["lang"], "body": match["body"],
                   "follows": not between.strip()})
    end = match.end()
  return blocks


def _joined(body: str) -> list[str]:
  """The lines of a shell block, continuations joined, comments dropped."""
  body = re.sub(r"\\\n\s*", "", body)
  lines = [re.sub(r"(^|\s)#.*$", "", l).strip() for l in body.splitlines()]
  return [l for l in lines if l]


def readme_commands(text: str) -> tuple[list[str], list[dict]]:
  """The README's commands in order (each once), and its fenced blocks that
  are neither Python nor commands."""
  commands, others = [], []
  for block in fenced_blocks(text):
    if block["lang"] == "python":
      continue
    lines = _joined(block["body"])
    if block["lang"] in ("bash", "sh") or (
        block["lang"] == "" and lines
        and all(l.startswith(("python", "export")) for l in lines)):
      for line in lines:  # An `export` (and its quoted lines) goes with the
        if line.startswith(_PROGRAMS):  # command after it.
          commands += [c.strip() for c in line.split("&&")]
    else:
      others.append(block)
  prose = _FENCE.sub("", text)
  if _REFERENCE_BEGIN in prose:  # Generated from the flags; test_docs checks it.
    prose = (prose[:prose.index(_REFERENCE_BEGIN)]
             + prose[prose.index(_REFERENCE_END):])
  commands += _INLINE.findall(re.sub(r"\s*\n\s*", " ", prose))
  return list(dict.fromkeys(commands)), others


def _is_shown_output(block: dict, blocks: list[dict]) -> bool:
  """A plain block right after a Python block: checked with that block."""
  index = blocks.index(block)
  return (block["lang"] == "" and block["follows"] and index > 0
          and blocks[index - 1]["lang"] == "python")


_TEXT = open(README).read()
README_COMMANDS, OTHER = readme_commands(_TEXT)


def test_the_command_parser():
  text = ("run `python -m tfmgpu.doctor` or\n```bash\npython3 -m pip install ."
          " && python -m x \\\n    --y=1  # note\n```\n\n```\nshown\n```\n"
          "```\npython -m tfmgpu.train --plan_only\n```\n")
  commands, others = readme_commands(text)
  assert commands == ["python3 -m pip install .", "python -m x --y=1",
                      "python -m tfmgpu.train --plan_only",
                      "python -m tfmgpu.doctor"]
  assert [b["body"] for b in others] == ["shown\n"]
  assert others[0]["follows"]


def test_every_block_and_command_is_run_or_listed():
  """Issue 29 item 8: a new block or command must be run or say why not."""
  unlisted = [c for c in README_COMMANDS if c not in COMMANDS]
  assert not unlisted, (
      f"README.md commands neither run nor listed: {unlisted}. Add each to "
      "COMMANDS in tests/test_readme_blocks.py: how to run it cheaply, or "
      "why it is not run.")
  stale = [c for c in COMMANDS if c not in README_COMMANDS]
  assert not stale, f"COMMANDS lists commands the README no longer has: {stale}"
  blocks = fenced_blocks(_TEXT)
  for block in OTHER:
    if _is_shown_output(block, blocks):
      continue
    first = block["body"].splitlines()[0]
    assert any(first.startswith(k) for k in OTHER_BLOCKS), (
        f"README.md:{block['line']}: a ```{block['lang']} block neither run "
        f"nor listed (starts {first!r}): add it to OTHER_BLOCKS with what it "
        "is, or make it a command or Python block.")
  for command, how in COMMANDS.items():
    assert how[0] in ("run", "help", "not run"), (command, how)
    if how[0] == "not run":
      assert len(how[1].split()) >= 3, f"say why {command!r} is not run"
  print("not run:", {c: h[1] for c, h in COMMANDS.items() if h[0] == "not run"})


def _argv(command: str, how: tuple) -> list[str]:
  argv = shlex.split(command)
  if argv[0] in ("python", "python3"):
    argv[0] = sys.executable
  if how[0] == "help":
    program = argv[:3] if argv[1] == "-m" else argv[:2]
    return program + ["--help"]
  return argv + shlex.split(how[1])


# Commands that must run in order in one directory (the second reads what
# the first wrote).
_SEQUENCES = [
    ["python scripts/write_tfrecords.py --dataset=digits "
     "--output_dir=data/digits --num_shards=8",
     "python -m tfmgpu.train --dataset=tfrecord "
     "--data_path='data/digits/*.tfrecord' --strategy=mirrored "
     "--virtual_devices=2 --epochs=5"],
    ["python -m tfmgpu.train --model=gpt --strategy=mirrored "
     "--virtual_devices=2 --model_dir=runs/gpt",
     "python -m tfmgpu.generate --model_path=runs/gpt/model.keras "
     "--prompt=\"import \" --sampler=top_k --top_k=5 --temperature=0.8 "
     "--sample_seed=0"],
]
_IN_SEQUENCE = {c for seq in _SEQUENCES for c in seq}


def _check_tfrecord_run(outs: list, cwd) -> None:
  """The README's TFRecord sequence, run as written: the script writes 8
  shards per split and prints the `--data_path` to pass; 5 epochs of
  mirrored x2 training stream them (logged) to a test accuracy >= 0.93."""
  from tfmgpu.datasets import tfrecord  # pylint: disable=g-import-not-at-top
  written, trained = outs
  assert "--data_path='" + str(cwd / "data" / "digits") + "/*.tfrecord'" in (
      written.stdout), written.stdout[-2000:]
  source = tfrecord.open_source(str(cwd / "data" / "digits" / "*.tfrecord"))
  assert (len(source.train.files), len(source.test.files),
          source.train.num_examples, source.test.num_examples) == (
              8, 8, 4000, 1000)
  assert "Data: TFRecordSource('digits': train 4000 examples in 8 files" in (
      trained.stderr), trained.stderr[-3000:]
  assert "Training data: the given dataset function" in trained.stderr
  accuracy = float(re.search(r"test loss / accuracy\s+[\d.]+ / ([\d.]+)",
                             trained.stdout).group(1))
  assert accuracy >= 0.93, trained.stdout[-3000:]
  print(f"tfrecord CLI test accuracy {accuracy:.4f}")


# What a sequence's outputs must show besides a clean exit, by its first
# command: `check(outs, cwd)`, `outs` the commands' `CompletedProcess`es.
_SEQUENCE_CHECKS = {_SEQUENCES[0][0]: _check_tfrecord_run}


def _train_devices(argv: list[str]) -> str | None:
  """For a `tfmgpu.train` command, its `--virtual_devices` (`""`: none);
  else `None`."""
  if argv[1:3] != ["-m", "tfmgpu.train"]:
    return None
  return next((a.split("=", 1)[1] for a in argv
               if a.startswith("--virtual_devices=")), "")


def _checked() -> list[tuple[str, list[str]]]:
  """What `test_readme_command_runs` runs: `(how, commands)`, each one test.

  `"in order"`: each command in its own process, in order, in one
  directory (a `_SEQUENCES` entry; or commands whose argv is the same, as
  `--help` of one program: run once). `"one process"`: `tfmgpu.train`
  commands that split the devices alike, run one after another in one
  process (TensorFlow imported once; a process cannot split its devices
  twice), as `python -m tfmgpu.train` runs them.
  """
  by_argv: dict[tuple, list[str]] = {}
  for command, how in COMMANDS.items():
    if how[0] != "not run" and command not in _IN_SEQUENCE:
      by_argv.setdefault(tuple(_argv(command, how)), []).append(command)
  checked, trains = [("in order", seq) for seq in _SEQUENCES], {}
  for argv, commands in by_argv.items():
    runs = COMMANDS[commands[0]][0] == "run"  # Not a --help check.
    devices = _train_devices(list(argv)) if runs else None
    if devices is None:
      checked.append(("in order", commands))
    else:
      trains.setdefault(devices, []).extend(commands)
  return checked + [("one process", c) for c in trains.values()]


_CHECKED = _checked()

# Runs `tfmgpu.train` once per argv of `sys.argv[1]` (JSON) in this process,
# as `python -m tfmgpu.train ARGS` would, and prints the exit codes.
_TRAIN_IN_ONE_PROCESS = """
import json, sys
from absl import flags
from tfmgpu import train
codes = []
for args in json.loads(sys.argv[1]):
  flags.FLAGS.unparse_flags()  # Each command from the defaults.
  sys.argv = [train.__file__, *args]
  try:
    train.run()
  except SystemExit as e:
    codes.append(e.code)
print("exit codes:", json.dumps(codes))
"""


def _run(argv: list[str], cwd, env) -> subprocess.CompletedProcess:
  return subprocess.run(argv, cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("how, sequence", _CHECKED,
                         ids=[" + ".join(s) for _, s in _CHECKED])
def test_readme_command_runs(how, sequence, tmp_path):
  """Each command as written (plus the args that make it cheap), from a
  directory holding the checkout's scripts/, with TF's logs at the CLIs'
  defaults: no C++ log line may show."""
  os.symlink(os.path.abspath(os.path.join(ROOT, "scripts")),
             tmp_path / "scripts")
  env = {k: v for k, v in os.environ.items()
         if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG")}
  env["PYTHONPATH"] = os.pathsep.join(
      [os.path.abspath(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
  env["TFMGPU_CACHE_DIR"] = str(tmp_path / "cache")
  if how == "one process":
    args = [_argv(c, COMMANDS[c])[3:] for c in sequence]
    out = _run([sys.executable, "-c", _TRAIN_IN_ONE_PROCESS,
                json.dumps(args)], tmp_path, env)
    _check_output(" + ".join(sequence), out, (0,))
    assert f"exit codes: {json.dumps([0] * len(args))}" in out.stdout, (
        f"{sequence}: {out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return
  done, outs = [], []
  for command in sequence:
    argv = _argv(command, COMMANDS[command])
    if argv in done:  # The same --help as the command before: run once.
      continue
    done.append(argv)
    help_ = COMMANDS[command][0] == "help"
    out = _run(argv, tmp_path, env)
    # tfmgpu's CLIs exit 0 after --help (#29 item 12); a script run by
    # absl's plain `app.run` exits 1 after printing it.
    _check_output(command, out,
                  (0, 1) if help_ and "scripts/" in command else (0,))
    assert out.stdout.strip() or not help_, f"{command!r}: empty --help"
    outs.append(out)
  if sequence[0] in _SEQUENCE_CHECKS:
    _SEQUENCE_CHECKS[sequence[0]](outs, tmp_path)


def _check_output(command: str, out: subprocess.CompletedProcess,
                  ok: tuple[int, ...]) -> None:
  shown = f"\n--- stdout ---\n{out.stdout[-3000:]}\n--- stderr ---\n" \
          f"{out.stderr[-3000:]}"
  assert out.returncode in ok, f"{command!r} exited {out.returncode}:{shown}"
  found = _TF_CPP_LINE.search(out.stdout + out.stderr)
  assert not found, f"{command!r} printed TF's C++ log line " \
                    f"{found.group(0)!r}:{shown}"
