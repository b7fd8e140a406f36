"""An SFT step and a DPO step against TRL's SFTTrainer and DPOTrainer, on the same weights and batches.

The `small` preset (~31M parameters), float32, 2 threads. A step is what each trainer does per batch:
collate the rows, forward, the objective's loss, backward, and torch's fused AdamW (lr 3e-4, betas
0.9/0.95, weight decay 0.1, on both sides: TRL's default optimizer, passed to ours explicitly); the
outer loops (logging, schedulers, clipping) are left out on both sides.

- SFT: 4 rows of 256 tokens, the first 64 of each a prompt (not trained). Ours: `SFT.training_step` on
  `data.packing.collate`; TRL: `SFTTrainer.training_step` on its DataCollatorForLanguageModeling
  (labels prebuilt, so both train the same 768 tokens).
- DPO: 2 pairs, 128-token prompt + 128-token responses (two sequences of 256 per pair), sigmoid loss,
  beta 0.1, a live frozen reference. Ours: `DPO.training_step` on `data.dpo.collate_pairs`; TRL:
  `DPOTrainer.training_step` on its DataCollatorForPreference.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_posttrain.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, command_line, duel, emit, hf_copy, row_from, save, setup, small_model  # noqa: E402

PAD = 0


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def hf_tokenizer(vocab: int):
    """A word-level tokenizer whose words are the ids themselves ("5 17 9"): TRL wants one for its pad and
    end ids and for preparing its dataset; the timed steps collate token ids directly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="3"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="0", bos_token="1", eos_token="2",
                                   unk_token="3")


def trl_args(config_cls, folder: str, **extra):
    return config_cls(
        output_dir=folder, per_device_train_batch_size=4, learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.95,
        weight_decay=0.1, optim="adamw_torch_fused", use_cpu=True, report_to=[], logging_strategy="no",
        save_strategy="no", max_steps=1, dataloader_num_workers=0, seed=0, **extra,
    )


def ready(trainer):
    """A TRL trainer set up for stepping by hand: its optimizer built, as `train()` would."""
    trainer.create_optimizer()
    if getattr(trainer, "current_gradient_accumulation_steps", None) is None:
        trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def random_ids(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(4, 8192, (n,), generator=gen).tolist()


def objective_step(module, batch: Callable[[], dict]) -> Callable[[], None]:
    """One optimizer step of our objective: collate (`batch()`), training_step, backward, AdamW, zero_grad."""
    opt = module.configure_optimizers()

    def step() -> None:
        module.training_step(batch(), 0).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def trainer_step(trainer, rows: list[dict]) -> Callable[[], None]:
    """One optimizer step of a TRL trainer on `rows`: its collator, training_step, optimizer, zero_grad."""

    def step() -> None:
        trainer.training_step(trainer.model, trainer.data_collator(rows))
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    return step


# -- SFT ------------------------------------------------------------------------------------------------
def sft_pair(folder: str, hf, rows: int, seq_len: int, prompt: int):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from astrai_pl.data.packing import collate
    from astrai_pl.objectives import SFT

    gen = torch.Generator().manual_seed(0)
    ids = [random_ids(seq_len, gen) for _ in range(rows)]
    labels = [[-100] * prompt + r[prompt:] for r in ids]
    ours_rows = [dict(input_ids=i, labels=lab, document_ids=[0] * seq_len, position_ids=list(range(seq_len)))
                 for i, lab in zip(ids, labels)]
    trl_rows = [dict(input_ids=i, labels=lab) for i, lab in zip(ids, labels)]

    ours = objective_step(SFT(init_from=folder, optimizer=adamw).train(), lambda: collate(ours_rows, PAD))
    args = trl_args(SFTConfig, tempfile.mkdtemp(), dataset_kwargs={"skip_prepare_dataset": True}, max_length=None,
                    packing=False)
    trainer = ready(SFTTrainer(model=hf, args=args, train_dataset=Dataset.from_list(trl_rows),
                               processing_class=hf_tokenizer(8192)))
    return ours, trainer_step(trainer, trl_rows)


# -- DPO ------------------------------------------------------------------------------------------------
def dpo_pair(folder: str, hf, pairs: int, prompt: int, response: int):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from astrai_pl.data.dpo import collate_pairs
    from astrai_pl.objectives import DPO

    gen = torch.Generator().manual_seed(1)
    trl_rows = [dict(prompt_ids=random_ids(prompt, gen), chosen_ids=random_ids(response, gen),
                     rejected_ids=random_ids(response, gen)) for _ in range(pairs)]
    mask = [0] * prompt + [1] * response
    ours_rows = [dict(chosen_input_ids=r["prompt_ids"] + r["chosen_ids"], chosen_loss_mask=mask,
                      rejected_input_ids=r["prompt_ids"] + r["rejected_ids"], rejected_loss_mask=mask,
                      prompt_length=prompt) for r in trl_rows]

    dpo = DPO(init_from=folder, optimizer=adamw, beta=0.1, loss_type="sigmoid").train()
    collate = partial(collate_pairs, pad_id=PAD, max_seq_len=prompt + response)
    ours = objective_step(dpo, lambda: collate(ours_rows))
    reference = hf_copy(dpo.model).eval()
    args = trl_args(DPOConfig, tempfile.mkdtemp(), beta=0.1, loss_type=["sigmoid"], max_length=None)
    args.per_device_train_batch_size = pairs
    text = [{k: " ".join(map(str, r[f"{k}_ids"])) for k in ("prompt", "chosen", "rejected")} for r in trl_rows]
    trainer = ready(DPOTrainer(model=hf, ref_model=reference, args=args, train_dataset=Dataset.from_list(text),
                               processing_class=hf_tokenizer(8192)))
    return ours, trainer_step(trainer, trl_rows)


def import_trl(measures: list[str], command: str, json_path: str | None):
    """TRL, or None after writing a "not installable" row for each measure."""
    try:
        import trl
    except ImportError as err:
        rows = [Row(m, "TRL", None, note=f"not installable: {err}", command=command) for m in measures]
        emit(rows)
        save(rows, json_path)
        return None
    return trl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed steps per side, interleaved")
    parser.add_argument("--budget", type=float, default=60, help="seconds per objective after which no new "
                        "round starts (at least 3 rounds)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    setup()
    warnings.filterwarnings("ignore")
    command = command_line()
    trl = import_trl([f"{m} step" for m in ("SFT", "DPO")], command, args.json)
    if trl is None:
        return
    peer = f"TRL {trl.__version__} "
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        small_model().save_pretrained(folder)
        from transformers import AutoModelForCausalLM

        def hf():
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")

        ours, theirs = sft_pair(folder, hf(), rows=4, seq_len=256, prompt=64)
        result = duel(ours, theirs, args.reps, budget_s=args.budget)
        rows.append(row_from(result, "SFT step, 32-true, 4 x 256", peer + "SFTTrainer", 1, "s/step", command, 1.0))
        emit(rows[-1:])
        del ours, theirs
        ours, theirs = dpo_pair(folder, hf(), pairs=2, prompt=128, response=128)
        result = duel(ours, theirs, args.reps, budget_s=args.budget)
        rows.append(row_from(result, "DPO step, 32-true, 2 pairs x 256", peer + "DPOTrainer", 1, "s/step", command,
                             1.0))
        emit(rows[-1:])
    save(rows, args.json)


if __name__ == "__main__":
    main()
