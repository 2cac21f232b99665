"""`python -m fastddrive.cli` (as `accelerate launch ... -m fastddrive.cli eval` runs it)."""

from fastddrive.cli import main

main()
