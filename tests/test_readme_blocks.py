"""Every fenced Python block of README.md runs as-is, so the guide cannot drift.

Each block runs in a fresh interpreter (`sys.executable -c CODE`) in a
temporary directory: a block defines every name it uses, and one that needs
logical devices configures them itself. A block that cannot run on one CPU
machine (a multi-worker cluster, a TPU) carries, on the line right before its
fence, `<!-- illustrative: WHY -->`; it is listed and skipped, and must say why.
"""

import os
import re
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


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE,
                         ids=[f"line{b['line']}" for b in RUNNABLE])
def test_readme_block_runs(block, tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("TF_CONFIG", None)
  out = subprocess.run([sys.executable, "-c", block["code"]], cwd=tmp_path,
                       env=env, capture_output=True, text=True,
                       timeout=_TIMEOUT_S)
  assert out.returncode == 0, (
      f"README.md block at line {block['line']} exited {out.returncode}:\n"
      f"{block['code']}\n--- stdout ---\n{out.stdout[-4000:]}\n"
      f"--- stderr ---\n{out.stderr[-6000:]}")
  # Keras warns when fit's shuffle=True meets a dataset it cannot shuffle.
  assert "`shuffle=True` was passed" not in out.stderr, (
      f"README.md block at line {block['line']} makes Keras warn:\n"
      f"{out.stderr[-3000:]}")
  if block["shown"] is not None:
    printed = [line.rstrip() for line in out.stdout.splitlines()]
    shown = [line.rstrip() for line in block["shown"].splitlines()]
    assert any(printed[i:i + len(shown)] == shown
               for i in range(len(printed))), (
        f"README.md block at line {block['line']} no longer prints the output "
        f"shown after it:\n{block['shown']}\n--- it printed ---\n{out.stdout}")
