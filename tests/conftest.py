import os
import sys

import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# Small, deterministic property runs keep the suite well inside its time budget on 2 cores.
settings.register_profile("ci", max_examples=120, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
