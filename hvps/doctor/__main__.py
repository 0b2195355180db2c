"""``python -m hvps.doctor ARGS`` = ``hvps doctor ARGS`` (what ``hvpsrun --doctor`` starts on every rank)."""
import sys

from ..cli import main

sys.exit(main(["doctor", *sys.argv[1:]]))
