"""astrai_pl: pretraining, SFT, DPO and GRPO on one decoder transformer, driven by PyTorch Lightning."""

__version__ = "0.1.0"
