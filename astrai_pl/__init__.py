"""astrai_pl: pretraining, SFT, DPO and GRPO on one decoder transformer, driven by PyTorch Lightning."""

import os

# OpenMP threads sleep between parallel regions instead of spinning. Two OpenMP runtimes share this process
# (torch's and the one the CPU kernels are built with), and on a machine whose cores are shared — with each
# other or with another process — each one's spinning threads take the cores the other needs: with the
# default busy-wait, decoding on 2 cores ran 4-5x slower and burnt 5x the CPU time (docs/serving.md). It takes
# effect only where it is set before torch is first imported; an explicit setting is left as it is.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
