"""What a call leaves behind besides its output: its changed files as `file`
artifacts, the diff of its write roots (collect.py, diff.py)."""
