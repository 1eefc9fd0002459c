"""trainer_core test settings: one CPU thread each (the CI machine is small and shared)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads when it loads)

torch.set_num_threads(1)
