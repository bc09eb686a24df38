"""Regenerates the CLI reference in README.md from the real flags.

Usage: python scripts/update_cli_reference.py [--check]
(`python scripts/cli_reference.py` only prints it.)
"""

import os
import sys

import cli_reference  # scripts/cli_reference.py, beside this file.


def main() -> int:
  path = os.path.join(os.path.dirname(__file__), "..", "README.md")
  with open(path) as f:
    readme = f.read()
  updated = cli_reference.replace_section(readme, cli_reference.markdown())
  if "--check" in sys.argv[1:]:
    if updated != readme:
      print("README.md's CLI reference is out of date; run "
            "python scripts/update_cli_reference.py", file=sys.stderr)
      return 1
    return 0
  with open(path, "w") as f:
    f.write(updated)
  return 0


if __name__ == "__main__":
  sys.exit(main())
