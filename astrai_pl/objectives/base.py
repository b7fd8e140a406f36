"""The one base class of the objectives, and the free functions two or more of them share."""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
from abc import ABC, abstractmethod
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torchmetrics import MeanMetric

from ..checkpoint import CheckpointError, load_transformer
from ..checkpoint.loading import meta_transformer, weights_fingerprint
from ..checkpoint.lora_base import base_record
from ..deferred_init import check_meta_build, materialize, meta_skeleton, on_meta
from ..model import ConfigError, LoraConfig, ModelConfig
from ..model.lora import (
    LoraLinear,
    adapter_state,
    adapters_disabled,
    apply_lora,
    merge_lora,
    trainable_summary,
)
from ..model.nf4 import check_quantize, quantize_base
from ..model.trainable_tokens import TokenHead
from ..parallel import (
    ActivationCheckpointing,
    check_activation_checkpointing,
    configure_model,
    fp8_scales_after_step,
    is_dtensor,
)
from .global_counts import summed_over_ranks
from .losses import IGNORE_INDEX, cross_entropy, linear_cross_entropy, next_token_labels
from .options import check_fp8_options
from .schedules import fit_schedule_length


def check_accumulation(k: Any) -> int:
    """`k` when it is a whole number >= 1: Lightning divides every micro-batch loss by it, so 0 divides by zero
    and a negative k turns the loss around and training climbs it."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ConfigError(f"trainer.accumulate_grad_batches={k!r}: must be a whole number >= 1 (the micro-batches "
                          "summed into each optimizer step); set it to 1, or to the micro-batches per step")
    return int(k)


def context_limit(arch: ModelConfig) -> int | None:
    """Most positions the model is configured for: max_position_embeddings, or with linear, yarn or llama3 RoPE
    scaling `factor` × its original length when that is more; None under dynamic NTK, which rescales to any length.
    LongRoPE's max_position_embeddings is already its extended length."""
    kind = arch.rope_type
    if kind == "dynamic":
        return None
    if kind in ("default", "longrope"):
        return arch.max_position_embeddings
    original = arch.rope_scaling.get("original_max_position_embeddings") or arch.max_position_embeddings
    return max(arch.max_position_embeddings, int(float(arch.rope_scaling["factor"]) * original))


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy in eval mode whose parameters never require a gradient (reference / old policies)."""
    if on_meta(model):
        raise ConfigError("a frozen reference copy of a model built on the meta device would hold no weights on "
                          "any process (a meta-device build shards the policy alone); set beta: 0 or train a LoRA "
                          "adapter (its reference is the base), or set meta_init: false")
    frozen = copy.deepcopy(model).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    return frozen


def reference_scope(model: nn.Module):
    """Where `model` computes as its base: every LoRA adapter switched off (DPO's and GRPO's reference policy
    when training an adapter: no copy of the model is kept). A no-op for a model without adapters."""
    return adapters_disabled(model) if getattr(model, "lora_config", None) is not None else contextlib.nullcontext()


def check_reference_fingerprint(saved: float | None, current: float | None, init_from: str | None) -> None:
    """CheckpointError when a checkpoint's reference fingerprint (`saved`) is not that of the reference rebuilt
    from init_from (`current`): a resumed DPO or KTO run would train against another reference. None: unchecked."""
    if saved is not None and current is not None and not math.isclose(saved, current, rel_tol=1e-9):
        raise CheckpointError(
            f"the reference rebuilt from init_from={init_from!r} is not the one this run trained against (weights "
            f"fingerprint {current:.9g}, saved {saved:.9g}); restore the original init_from weights, or start a "
            "new run")


def as_lora(lora: LoraConfig | dict | None) -> LoraConfig | None:
    """A LoraConfig from itself or from its dict form (as checkpoints store it)."""
    return LoraConfig(**lora) if isinstance(lora, dict) else lora


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two optimizer groups: matrices and embeddings take the optimizer's weight decay; norms and biases
    (1-D tensors) take none."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


class Objective(L.LightningModule, ABC):
    """Holds a Transformer; subclasses implement `_shared_step(batch, stage) -> (loss, metrics)`.

    The options every objective takes are declared here once. A subclass declares only its own, keyword-only,
    and passes the rest on (`def __init__(self, *args, beta=0.1, **kwargs)`, `super().__init__(*args,
    **kwargs)`): a config still names them flat (`model.init_args.arch`), jsonargparse documents them from
    this docstring, and the hyperparameters saved here hold the shared options and the subclass's own.
    """

    def __init__(
        self,
        arch: ModelConfig | None = None,
        init_from: str | None = None,
        tokenizer: Any = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        *,
        activation_checkpointing: ActivationCheckpointing = "none",
        compile: bool = False,
        lora: LoraConfig | None = None,
        quantize: Literal["nf4"] | None = None,
        fp8: str | None = None,
        meta_init: bool = False,
    ):
        """
        Args:
            arch: Shape of a freshly initialised model (ignored when init_from is set).
            init_from: Start from these weights: a Hugging Face directory, an astrai-pl .ckpt (e.g. the
                previous stage's last.ckpt), or a hub id (owner/name[@revision], safetensors only; an existing
                local path of the same spelling wins; see docs/model.md). DPO's reference policy, and GRPO's when beta > 0, is a frozen
                copy of them.
            tokenizer: Set from the data module; used by export callbacks and sample generation, and by GRPO
                to decode completions for the reward functions.
            optimizer: Optimizer class and arguments (default AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1);
                its weight decay applies to matrices and embeddings, never to norms and biases. DPO usually
                wants a far smaller lr, e.g. 5e-7 to 5e-6 on large models.
            scheduler: Learning-rate schedule stepped per optimizer step (e.g. WarmupCosine); its max_steps
                left null is the trainer's length (trainer.estimated_stepping_batches).
            activation_checkpointing: Recompute activations in the backward pass instead of keeping them:
                "none", "full" (each whole block) or "selective" (keep matmul and attention outputs,
                recompute the pointwise ops between them). Less memory for more compute. GRPO's rollouts
                run without gradients and are unaffected.
            compile: torch.compile each block (the first steps are slower while it compiles); GRPO's
                rollouts run the same compiled blocks.
            lora: Train a LoRA adapter (PEFT's LoraConfig fields) instead of every weight: the base is frozen,
                the optimizer gets the adapter only, checkpoints hold the adapter and its optimizer state (the
                base is read again from init_from on resume), and DPO's and GRPO's reference is the base with
                the adapter switched off. See docs/adapters.md.
            quantize: "nf4": QLoRA. The frozen base's linear weights (all but the output layer) are stored in
                4-bit NF4 with double quantisation and dequantised inside each matmul; read straight into NF4
                from a Hugging Face init_from, quantised after initialisation on a fresh model. Needs lora.
            fp8: Train the linear layers' matmuls in FP8 (torchao's float8 linear layers): "tensorwise" (one scale
                per tensor; the faster, and under FSDP2 the weights are all-gathered in float8) or "rowwise" (one
                scale per row; the more accurate); null for none. The output layer, and any linear layer whose
                dimensions are not multiples of 16, keep their precision. Needs a GPU of compute capability 8.9
                or higher (refused elsewhere when the model is laid out); not with lora or quantize. Combine with
                precision: bf16-mixed. See docs/distributed.md.
            meta_init: Build the model on the meta device (shapes, no memory) and give each process only what it
                holds once laid out: with strategy: fsdp2, its shard of every weight, read from a Hugging Face
                init_from (each process reads only its slices) or drawn from the seed. For models bigger than
                one host's memory; also on when the objective is built under trainer.init_module(empty_init=True)
                with strategy: fsdp2. A fresh model's weights then depend on the seed alone, not on the process
                count, but differ from those of a model built whole with the same seed. Not with lora, quantize,
                an RWKV model, a .ckpt init_from, or a frozen reference copy (DPO, KTO, GRPO with beta > 0).
        """
        super().__init__()
        check_activation_checkpointing(activation_checkpointing)
        self.activation_checkpointing, self.compile_blocks = activation_checkpointing, compile
        check_quantize(quantize, lora)
        check_fp8_options(fp8, lora, quantize)
        self.fp8 = fp8
        deferred = meta_init or torch.get_default_device().type == "meta"  # init_module(empty_init=True), FSDP2
        if deferred:  # shapes only; configure_model fills each process's shards (astrai_pl/deferred_init.py)
            self.model, self._weights_dir = meta_transformer(arch, init_from)
            check_meta_build(self.model, lora, quantize)
            self._init_seed = torch.initial_seed()
        else:
            self.model = load_transformer(arch, init_from, quantize=quantize)
        if self.model.lora_config is not None:  # init_from a LoRA run's checkpoint: its adapter joins the base
            merge_lora(self.model)
        self.arch = self.model.config
        self.base_fingerprint, self.base_record = None, None
        if lora is not None:
            self.base_fingerprint = weights_fingerprint(self.model)
            if init_from:  # where the base is now, `latest` resolved: a later run may move it
                self.base_record = base_record(init_from, self.base_fingerprint)
            if quantize is not None:  # after a loaded adapter is merged; already NF4 when read from a directory
                quantize_base(self.model)
            apply_lora(self.model, as_lora(lora), tokenizer)  # token strings resolved with it
            self.strict_loading = False  # checkpoints hold the adapter only; on_load_checkpoint checks it
        self.tokenizer = tokenizer
        self.optimizer_fn, self.scheduler_fn = optimizer, scheduler
        with torch.device("cpu") if deferred else contextlib.nullcontext():
            self.val_loss = MeanMetric()  # its state is moved with the module, never built on the meta device
        # Lightning reads the arguments of every __init__ on the stack: these and the subclass's own.
        self.save_hyperparameters(ignore=["tokenizer", "optimizer", "scheduler"])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The model shape travels as a plain dict, so checkpoints load with weights_only=True; it is the
        # shape of the model actually trained, also when it came from init_from (arch None).
        hparams = checkpoint.setdefault("hyper_parameters", {})
        hparams["arch"] = self.arch.to_dict()
        if self.model.lora_config is not None:
            hparams["lora"] = self.model.lora_config.to_dict()
            self._keep_adapter_only(checkpoint)

    # -- LoRA checkpoints: the adapter and its optimizer state; the frozen base is read from init_from -------
    def _adapter_keys(self) -> set[str]:
        return {f"model.{k}" for k in adapter_state(self.model)}

    def _keep_adapter_only(self, checkpoint: dict[str, Any]) -> None:
        """Drop the frozen base from the checkpoint when init_from holds it; a fresh model's base, which nothing
        else holds, stays."""
        if not self.hparams.get("init_from"):
            return
        keep = self._adapter_keys()
        state = checkpoint.get("state_dict", {})
        checkpoint["state_dict"] = {k: v for k, v in state.items() if k in keep or not k.startswith("model.")}
        checkpoint["lora_base"] = self.base_record

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A LoRA run resumes from a checkpoint of the same adapter on the same base: both are checked here,
        since the state dict is loaded non-strictly (it holds no base weights)."""
        if self.model.lora_config is None:
            return
        state = checkpoint.get("state_dict", {})
        missing = sorted(self._adapter_keys() - state.keys())
        if missing:
            raise CheckpointError(f"this checkpoint lacks {len(missing)} weight(s) of the LoRA adapter configured "
                                  f"in model.init_args.lora (e.g. {missing[0]}). Fix: resume with the lora "
                                  "settings it was trained with, or start a new run from it with init_from")
        record = checkpoint.get("lora_base", {})
        saved = record.get("fingerprint")
        if saved is not None and not math.isclose(saved, self.base_fingerprint, rel_tol=1e-9):
            raise CheckpointError(f"the base weights in model.init_args.init_from={self.hparams.get('init_from')!r} "
                                  "are not those this LoRA checkpoint was trained on (their fingerprint differs). "
                                  "Fix: point init_from at the same base model: the checkpoint records "
                                  f"{record.get('init_from')!r} (--model.init_args.init_from with that path)")

    def train(self, mode: bool = True):
        """Training mode for the policy; a frozen reference copy (`ref_model`, where the objective keeps one as
        a child module) stays in eval mode, which `LightningModule.train()` would take it out of."""
        super().train(mode)
        reference = getattr(self, "ref_model", None)
        if reference is not None:
            reference.eval()
        return self

    def on_fit_start(self) -> None:
        if self.model.lora_config is not None:
            rank_zero_info(f"LoRA: {trainable_summary(self.model)}")
        self.prepare_reference()

    def on_validation_start(self) -> None:
        self.prepare_reference()

    def on_test_start(self) -> None:
        self.prepare_reference()

    def prepare_reference(self) -> None:
        """Before the first step of fit, validate or test: what the reference needs once (DPO and KTO fill their
        precomputed tables here, `reference_tables`). Nothing by default."""

    # -- before step 1: what this model cannot train on is refused -----------------------------------------
    def setup(self, stage: str) -> None:
        """Refuse a trainer or data module this model cannot run on: an accumulation that is not >= 1 (fit), a
        tokenizer with more ids than the embedding has rows, sequences longer than the model's positions."""
        if stage == "fit":
            check_accumulation(self.trainer.accumulate_grad_batches)
        datamodule = self.trainer.datamodule
        self.check_vocabulary(getattr(datamodule, "tokenizer", None) or self.tokenizer)
        self.check_sequence_length(self.longest_sequence(datamodule))

    def longest_sequence(self, datamodule: Any) -> tuple[str, int] | None:
        """The config field that bounds the longest sequence this objective runs on, and its value."""
        hparams = getattr(datamodule, "hparams", {})
        for name in ("seq_len", "max_seq_len"):
            if name in hparams:
                return f"data.init_args.{name}", int(hparams[name])
        return None

    def check_vocabulary(self, tokenizer: Any) -> None:
        """ConfigError when the tokenizer has ids that the model's embedding has no row for."""
        n = getattr(tokenizer, "vocab_size", None)
        if n is not None and n > self.arch.vocab_size:
            raise ConfigError(f"{self._arch_field('vocab_size')}: smaller than the {n} ids of the tokenizer "
                              "(data.init_args.tokenizer), whose ids past it would index beyond the embedding; "
                              f"give the model a vocab_size of at least {n}, or use the model's own tokenizer")

    def check_sequence_length(self, longest: tuple[str, int] | None) -> None:
        """ConfigError when `longest` (field, tokens) exceeds the positions the model is configured for."""
        limit = context_limit(self.arch)
        if longest is not None and limit is not None and longest[1] > limit:
            field, n = longest
            raise ConfigError(f"{field}={n}: longer than the {limit} positions of the model "
                              f"({self._arch_field('max_position_embeddings')}); set {field} to at most {limit}, "
                              "or use a model with a longer context")

    def _arch_field(self, name: str) -> str:
        """How a config names this model's `name` and its value: an arch field, or a property of init_from."""
        init_from = getattr(self, "hparams", {}).get("init_from")
        value = getattr(self.arch, name)
        if init_from:
            return f"{name}={value} of the model in model.init_args.init_from={init_from!r}"
        return f"model.init_args.arch.{name}={value}"

    def configure_model(self) -> None:
        """FP8, tensor parallel, activation checkpointing, compile and FSDP2, as configured (astrai_pl/parallel.py);
        then, for a model built on the meta device, each process's shards are filled (astrai_pl/deferred_init.py)."""
        strategy = self.trainer.strategy
        skeleton = meta_skeleton(self.model)  # before the layout: the whole shapes
        configure_model(self.model, strategy, self.activation_checkpointing, self.compile_blocks, fp8=self.fp8)
        if skeleton is not None:
            seed = strategy.broadcast(self._init_seed)  # rank 0's: every process draws the same weights
            materialize(self.model, skeleton, strategy.root_device, self._weights_dir, seed)

    # -- the steps: one shared body for train / val / test ----------------------------------------------
    @abstractmethod
    def _shared_step(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """The objective's loss on one batch and its metrics (detached tensors)."""

    def next_token_loss(
        self, batch: dict[str, torch.Tensor], label_smoothing: float = 0.0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross-entropy of every trained next token (labels != -100), plus the weighted MoE auxiliary loss.

        The lm_head and the loss run fused (`linear_cross_entropy`): the (B, T, V) logits are never
        built and untrained positions never reach the lm_head. Under tensor parallelism, whose lm_head
        weight is a DTensor, the lm_head module runs and `cross_entropy` takes its logits.
        """
        hidden, aux = self.model.hidden_states(batch["input_ids"], batch.get("position_ids"), batch.get("document_ids"))
        targets = next_token_labels(batch["labels"])
        tokens = (targets != IGNORE_INDEX).sum()
        normalizer = self.accumulation_scale(batch, tokens)
        head = self.model.lm_head
        weight = head.merged_weight() if isinstance(head, TokenHead) else head.weight  # trained token rows in
        # a capped head is not fusable, nor a LoRA-adapted one (the fused loss would read its base weight only)
        if is_dtensor(weight) or getattr(head, "softcap", None) is not None or isinstance(head, LoraLinear):
            loss, metrics = cross_entropy(self.model.lm_head(hidden), targets, label_smoothing=label_smoothing,
                                          normalizer=normalizer)
        else:
            loss, metrics = linear_cross_entropy(hidden, weight, targets, label_smoothing=label_smoothing,
                                                 normalizer=normalizer)
        if aux is not None:
            weighted = self.arch.router_aux_loss_coef * aux
            loss = loss + weighted
            metrics.update(aux_loss=aux.detach(), aux_loss_weighted=weighted.detach())
        return loss, metrics

    def training_step(self, batch, batch_idx):
        loss, metrics = self._shared_step(batch, "train")
        self.log_dict({f"train/{k}": v.float() for k, v in metrics.items()}, on_step=True, on_epoch=False)
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def _evaluate(self, batch, stage: str) -> None:
        loss, metrics = self._shared_step(batch, stage)
        self.val_loss.update(metrics.get("nll", loss), weight=metrics.get("tokens", 1))
        self.log_dict({f"{stage}/{k}": v for k, v in metrics.items() if k not in ("nll", "tokens")},
                      on_epoch=True)

    def on_validation_epoch_start(self):
        self._reset_eval_loss()

    def on_test_epoch_start(self):
        self._reset_eval_loss()

    def _reset_eval_loss(self) -> None:
        # Fresh normal tensors: a state created under inference mode (trainer.validate) could not be
        # updated later under no_grad (validation inside fit).
        with torch.inference_mode(False):
            self.val_loss.reset()

    def on_validation_epoch_end(self):
        self._log_eval_loss("val")

    def on_test_epoch_end(self):
        self._log_eval_loss("test")

    def _log_eval_loss(self, stage: str) -> None:
        loss = self.val_loss.compute()
        self.log(f"{stage}/loss", loss, prog_bar=True)
        self.log(f"{stage}/ppl", torch.exp(loss.clamp(max=50)))

    # -- optimisation ------------------------------------------------------------------------------------
    def configure_optimizers(self):
        groups = param_groups(self.model)
        if self.optimizer_fn is None:
            optimizer = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        else:
            optimizer = self.optimizer_fn(groups)
        if self.fp8 is not None:
            fp8_scales_after_step(self.model, optimizer)
        if self.scheduler_fn is None:
            return optimizer
        scheduler = self.scheduler_fn(optimizer)
        fit_schedule_length(scheduler, self.trainer)  # max_steps None: the trainer's length
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def accumulation_scale(
        self, batch: dict[str, Any], tokens: torch.Tensor, key: str = "window_tokens"
    ) -> torch.Tensor:
        """Normaliser that makes accumulated gradients the exact mean over the window's trained tokens.

        Lightning divides each micro-batch loss by `accumulate_grad_batches` (K). When the loader tags
        every micro-batch with `window_tokens` (trained tokens in its whole accumulation window, the
        short last window included), dividing the summed loss by window_tokens / K cancels that
        division: Σ_micro (sum_nll / window_tokens) is the token mean over the window. Another count
        works the same way under its own `key` (DPO: pairs, `window_pairs`). Under data parallelism the
        count is summed over the W ranks and divided by W (`global_counts`): DDP's average of the ranks'
        gradients is then that of the global batch, whatever each rank's share of its tokens.
        """
        if not self.training:
            return tokens.clamp(min=1)
        window = batch.get(key)
        count = tokens if window is None else torch.as_tensor(window, device=tokens.device)
        total, ranks = summed_over_ranks(count, self._trainer)
        steps = 1 if window is None else self.accumulation_steps()
        return total.float().clamp(min=1) / (steps * ranks)

    def accumulation_steps(self) -> int:
        """The trainer's accumulate_grad_batches (K), checked; 1 without a trainer."""
        return check_accumulation(self.trainer.accumulate_grad_batches) if self._trainer is not None else 1

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)
