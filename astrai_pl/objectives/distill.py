"""On-policy distillation (GKD): the student learns the teacher's next-token distributions on sequences it
sampled itself (a `lmbda` share of the steps, on the inference engine), on the data set's own completions,
or on the teacher's (`seq_kd`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from ..inference import SamplingParams
from ..model import ConfigError
from .base import Objective
from .global_counts import rank_share
from .logprobs import scored_rows
from .on_policy import (
    check_whole_model,
    longest_prompted_sequence,
    policy_engine,
    require_prompts,
    sample_packed,
)
from .on_policy_losses import check_jsd_beta, generalized_jsd_loss, topk_generalized_jsd_loss
from .options import require
from .rollout import pack
from .teachers import ModelTeacher, ServerTeacher, TeacherError, next_token_targets


def reference_completion_ids(tokenizer: Any, prompt: Any, text: str) -> list[int]:
    """The ids of `text` as the answer to `prompt`: for a conversation, what the chat template puts after the
    generation prompt for an assistant turn of `text` (its end-of-turn token included, trailing whitespace
    not); for a plain prompt, `text` and the end-of-sequence token."""
    if isinstance(prompt, list):
        head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": text}], tokenize=False)
        if whole.startswith(head):
            return tokenizer.encode(whole[len(head):].rstrip())
    return [*tokenizer.encode(text), tokenizer.eos_token_id]


class _Given:
    """A completion given as ids (the data set's), shaped as the engine's Completion for `rollout.pack`."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids, self.logprobs, self.finish_reason = list(token_ids), None, "stop"


class Distill(Objective):
    """Generalised knowledge distillation (Agarwal et al., 2024, "On-Policy Distillation of Language Models") as
    TRL's GKDTrainer. Each training step, with probability λ (`lmbda`) the batch's prompts are continued by the
    student on the inference engine (on-policy), else by the teacher (`seq_kd`) or by the data set's own
    completion (the `completion_column`); on the completion tokens of those sequences

        L = Σ_t JSD_β(π_student(· | y_<t), π_teacher(· | y_<t)) / N        (`generalized_jsd_loss`)

    N the completion tokens of the batch. With a teacher behind a server only its top-k log-probabilities are
    known: the divergence is taken over those k tokens, both sides renormalised there
    (`topk_generalized_jsd_loss`). Validation logs the divergence on the data set's completions (val/loss).
    """

    def __init__(
        self,
        *args: Any,
        teacher_model: str | None = None,
        teacher_url: str | None = None,
        teacher_model_name: str | None = None,
        teacher_top_k: int = 20,
        teacher_api_key_env: str | None = None,
        teacher_timeout: float = 60.0,
        lmbda: float = 0.5,
        beta: float = 0.5,
        temperature: float = 0.9,
        max_new_tokens: int = 128,
        seq_kd: bool = False,
        completion_column: str = "answer",
        engine_page_size: int = 16,
        engine_max_total_tokens: int | None = None,
        **kwargs: Any,
    ):
        """
        Args:
            teacher_model: The teacher's weights: a Hugging Face directory or an astrai-pl .ckpt (it must share
                the student's tokenizer). Exactly one of teacher_model and teacher_url.
            teacher_url: Base URL (without /v1) of an OpenAI-compatible server that serves the teacher, e.g.
                http://127.0.0.1:8000 from `astrai-pl serve --model TEACHER`; it is asked for top-k log-probs.
            teacher_model_name: The `model` field of the server requests; None = left out (the server's only one).
            teacher_top_k: Log-probabilities asked of the server per position (the divergence's support).
            teacher_api_key_env: Name of the environment variable holding the server's API key; None = no key.
            teacher_timeout: Seconds one request to the server may take.
            lmbda: Share of the training steps on student-generated completions (TRL's λ; 0 = off-policy only,
                1 = on-policy only).
            beta: β of the generalised JSD: 0 = forward KL(teacher‖student), 1 = reverse KL(student‖teacher).
            temperature: Sampling temperature of the generated completions (as TRL, the divergence itself is
                taken at temperature 1).
            max_new_tokens: Most tokens per generated completion (the stop token included).
            seq_kd: On the steps that are not on-policy, train on the teacher's own greedy completions instead of
                the data set's (sequence-level KD); needs teacher_model.
            completion_column: The data set's column holding each prompt's reference completion (text).
            engine_page_size: Tokens per KV page of the generation engines.
            engine_max_total_tokens: KV pool of the generation engines in tokens; None = room for a whole batch.
        """
        if (teacher_model is None) == (teacher_url is None):
            raise ConfigError(f"Distill.teacher_model={teacher_model!r}, teacher_url={teacher_url!r}: give exactly one "
                              "(a model directory or checkpoint, or the base URL of a server that serves the teacher)")
        require(0.0 <= lmbda <= 1.0, "Distill.lmbda", lmbda, "must lie in [0, 1] (the share of on-policy steps); "
                "TRL's default is 0.5")
        check_jsd_beta(beta)
        require(temperature > 0, "Distill.temperature", temperature, "must be > 0; TRL's default is 0.9")
        require(max_new_tokens >= 1, "Distill.max_new_tokens", max_new_tokens, "must be >= 1")
        require(teacher_top_k >= 1, "Distill.teacher_top_k", teacher_top_k, "must be >= 1 (e.g. 20)")
        require(not (seq_kd and teacher_model is None), "Distill.seq_kd", seq_kd,
                "needs teacher_model: the teacher's completions are generated on our engine; set seq_kd: false")
        require(engine_page_size >= 1, "Distill.engine_page_size", engine_page_size, "must be >= 1")
        super().__init__(*args, **kwargs)
        self._teacher = None if teacher_model is not None else ServerTeacher(
            teacher_url, teacher_model_name, teacher_top_k, teacher_api_key_env, teacher_timeout)
        self._engines: dict[str, Any] = {}  # "student" / "teacher": the generation engines, built on first use
        self.trained_sequences: dict[str, torch.Tensor] | None = None  # the last training step's packed sequences

    @property
    def teacher(self) -> ModelTeacher | ServerTeacher:
        """The teacher; a teacher_model is read on first use (a config naming one that a previous stage will
        write parses before it exists)."""
        if self._teacher is None:
            path = self.hparams.teacher_model
            teacher = ModelTeacher(path)
            if teacher.model.config.vocab_size != self.arch.vocab_size:
                raise ConfigError(f"Distill.teacher_model={path!r} has vocab_size={teacher.model.config.vocab_size}, "
                                  f"the student {self.arch.vocab_size}: teacher and student must share one tokenizer "
                                  "and vocabulary")
            self._teacher = teacher
        return self._teacher

    def setup(self, stage: str) -> None:
        """As every objective's, and the teacher is read (a missing or mismatched one fails before step 1)."""
        super().setup(stage)
        _ = self.teacher

    def configure_model(self) -> None:
        check_whole_model("Distill", self.trainer if self._trainer is not None else None)
        super().configure_model()

    def longest_sequence(self, datamodule: Any) -> tuple[str, int] | None:
        return longest_prompted_sequence(datamodule, "max_new_tokens", self.hparams.max_new_tokens)

    # -- the sequences -----------------------------------------------------------------------------------
    def source(self, stage: str) -> str:
        """Who continues this step's prompts: "student" (probability lmbda, training only), "teacher" (seq_kd)
        or "data"."""
        if stage == "train" and random.random() < self.hparams.lmbda:
            return "student"
        return "teacher" if stage == "train" and self.hparams.seq_kd else "data"

    @torch.no_grad()
    def sequences(self, batch: dict[str, list], source: str) -> dict[str, torch.Tensor]:
        """The batch's prompts and their completions by `source`, packed (`rollout.pack`)."""
        require_prompts("Distill", batch)
        prompt_ids, pad = batch["prompt_ids"], self.tokenizer.pad_token_id
        if source == "data":
            column = self.hparams.completion_column
            if column not in batch:
                raise ValueError(f"Distill.completion_column={column!r}: the batch has no such column (it has "
                                 f"{sorted(batch)}); name the column of the reference completions")
            prompts = batch.get("prompt") or batch.get("prompt_text")
            given = [_Given(reference_completion_ids(self.tokenizer, p, str(t))) for p, t in zip(prompts, batch[column])]
            return pack(list(zip(prompt_ids, given)), pad, self.device)
        hp = self.hparams
        model = self.model if source == "student" else self.teacher.on(self.device)
        self._engines[source] = policy_engine(self._engines.get(source), model, self.tokenizer, prompt_ids, 1,
                                              hp.max_new_tokens, hp.engine_page_size, hp.engine_max_total_tokens,
                                              "Distill")
        temperature = hp.temperature if source == "student" else 0.0
        params = SamplingParams(max_tokens=hp.max_new_tokens, temperature=temperature)
        return sample_packed(self._engines[source], prompt_ids, params, pad, self.device)[1]

    # -- the step ----------------------------------------------------------------------------------------
    def _shared_step(self, batch: dict[str, Any], stage: str):
        source = self.source(stage)
        part = self.sequences(batch, source)
        if self.training:
            self.trained_sequences = part  # what ProgressLines counts as this step's tokens
        hidden, _ = self.model.hidden_states(part["input_ids"])
        rows, _, _ = scored_rows(hidden, next_token_targets(part["labels"]))  # (N, H)
        student = self.model.lm_head(rows)  # (N, V)
        hp = self.hparams
        if isinstance(self.teacher, ModelTeacher):
            teacher = self.teacher.logits(part["input_ids"], part["labels"])  # (N, V)
            loss, metrics = generalized_jsd_loss(student, teacher, beta=hp.beta)
        else:
            ids, logps = self.teacher.top_logprobs(part["input_ids"], part["labels"])  # (N, K)
            if ids.numel() and int(ids.max()) >= student.size(-1):  # ids are >= 0: parsed from "token_id:<digits>"
                raise TeacherError(f"the teacher server at {hp.teacher_url} named token id {int(ids.max())}, past the "
                                   f"student's {student.size(-1)} ids: teacher and student must share a tokenizer")
            loss, metrics = topk_generalized_jsd_loss(student, ids, logps, beta=hp.beta)
        metrics["on_policy"] = torch.tensor(float(source == "student"))
        if self.training:  # a mean over every rank's scored positions (`global_counts`)
            loss = loss * rank_share(metrics["tokens"].round().long(), loss.device, self._trainer)
        return loss, metrics

    def _evaluate(self, batch, stage: str) -> None:
        loss, metrics = self._shared_step(batch, stage)
        self.val_loss.update(loss.detach(), weight=metrics["tokens"])

    def _log_eval_loss(self, stage: str) -> None:
        self.log(f"{stage}/loss", self.val_loss.compute(), prog_bar=True)  # a divergence: no perplexity
