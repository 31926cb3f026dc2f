import os
import sys

# Make the source tree importable without an install (CI installs it editable anyway):
# `pdserve` from the repo root and `pdserve_kernels` from kernels/.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Without CUDA the Triton kernels run only interpreted, and TRITON_INTERPRET must be set before
# anything imports triton (the model reaches the kernels too), whichever test file comes first.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def restore_torch_threads():
    """An engine with cpu_threads sets torch's threads process-wide: leave the rest of the suite as found."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
