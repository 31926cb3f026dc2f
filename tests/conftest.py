import os
import sys

# Make the source tree importable without an install (CI installs it editable anyway):
# `pdserve` from the repo root and `pdserve_kernels` from kernels/.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
