"""KTO, ORPO, reward-model and GRPO steps against TRL's KTOTrainer, ORPOTrainer, RewardTrainer, GRPOTrainer.

Same setting as bench_posttrain.py (its helpers): the `small` preset (~31M parameters) saved with our
save_pretrained and loaded by `transformers` for TRL, float32, 2 threads, the same rows on both sides, one
optimizer step of fused AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1) per repetition; logging, schedulers
and clipping left out on both sides. How TRL is set to do our work:

- KTO: 4 examples (2 desirable, 2 undesirable), 128-token prompt + 128-token completion, beta 0.1, loss 'kto'
  with its KL reference point from mismatched pairs (each prompt with the previous example's completion: TRL's
  KL_completion_ids rotation and our collate_unpaired agree), a live frozen reference on both sides. Ours:
  `KTO.training_step` on `data.kto.collate_unpaired`; TRL: `KTOTrainer.training_step` on its
  DataCollatorForUnpairedPreference.
- ORPO: 2 pairs, 128-token prompt + 128-token responses, beta 0.1. TRL's ORPOTrainer (trl.experimental) adds a
  BOS to the prompt and an EOS to each response when it tokenizes its dataset; both sides train those rows
  (ours are read from TRL's tokenized dataset). Ours: `ORPO.training_step` on `data.dpo.collate_pairs`; TRL:
  `ORPOTrainer.training_step` on its DPODataCollatorWithPadding.
- Reward model: 2 pairs x 256 tokens, Bradley-Terry loss, no centring. Ours: `RewardModel` (a fresh score
  head), written with `save_reward_model` and loaded by AutoModelForSequenceClassification for TRL, so both
  score with the same head; `RewardModel.training_step` on `collate_pairs` against
  `RewardTrainer.training_step` on its DataCollatorForPreference.
- GRPO: one step = rollout + update: 4 prompts of 32..64 tokens x num_generations 4, max_completion_length 48,
  temperature 1, no top-k / top-p, beta 0 (TRL's default: no reference model), loss 'dapo', scale_rewards
  'group', one optimizer step per rollout (TRL: per_device_train_batch_size = 16 completions, so
  steps_per_generation 1). The reward (`even_share`) is the same function on both sides. Both tokenizers'
  end-of-sequence id is 8192, outside the model's 8192-token vocabulary, so no completion stops early and both
  sides sample and train exactly 4 x 4 x 48 tokens. TRL samples with transformers' `generate`
  (use_vllm False); ours with our Engine, as `GRPO.training_step` does (its rollout and `_shared_step` are
  called directly: without a Lightning Trainer there is nothing to log to).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_posttrain_more.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_posttrain import (  # noqa: E402
    PAD,
    adamw,
    import_trl,
    objective_step,
    random_ids,
    ready,
    trainer_step,
    trl_args,
)
from harness import command_line, duel, emit, row_from, save, setup, small_model  # noqa: E402

VOCAB = 8192
EOS = VOCAB  # an id the model cannot sample: rollouts always run to max_completion_length


def word_tokenizer(eos: int = 2, padding_side: str = "right"):
    """A word-level tokenizer whose words are the ids themselves ("5 17 9" → [5, 17, 9]), so that TRL's own
    tokenization of our rows gives back their ids. The special tokens are named <pad> (0), <s> (1), <unk> (3)
    and </s> (`eos`): named "0" to "3", they would split every number with those digits."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<pad>": 0, "<s>": 1, "<unk>": 3, "</s>": eos}
    words = {**{str(i): i for i in range(4, VOCAB)}, **specials}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", padding_side=padding_side)


def text(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def hf_causal(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")


# -- KTO ------------------------------------------------------------------------------------------------
def kto_pair(folder: str, examples: int, prompt: int, completion: int):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from astrai_pl.data.kto import collate_unpaired
    from astrai_pl.objectives import KTO

    gen = torch.Generator().manual_seed(2)
    trl_rows = [dict(prompt_ids=random_ids(prompt, gen), completion_ids=random_ids(completion, gen),
                     label=i % 2 == 0) for i in range(examples)]
    for i, r in enumerate(trl_rows):  # TRL's rotation: (x_i, y_{i-1}), the first takes the last's
        r["KL_completion_ids"] = trl_rows[i - 1]["completion_ids"]
    mask = [0] * prompt + [1] * completion
    ours_rows = [dict(input_ids=r["prompt_ids"] + r["completion_ids"], loss_mask=mask, prompt_length=prompt,
                      label=r["label"]) for r in trl_rows]

    kto = KTO(init_from=folder, optimizer=adamw, beta=0.1, loss_type="kto").train()
    collate = partial(collate_unpaired, pad_id=PAD, max_seq_len=prompt + completion)
    ours = objective_step(kto, lambda: collate(ours_rows))
    args = trl_args(KTOConfig, tempfile.mkdtemp(), beta=0.1, loss_type="kto", max_length=None)
    args.per_device_train_batch_size = examples
    dataset = Dataset.from_list([dict(prompt=text(r["prompt_ids"]), completion=text(r["completion_ids"]),
                                      label=r["label"]) for r in trl_rows])
    trainer = ready(KTOTrainer(model=hf_causal(folder), ref_model=hf_causal(folder).eval(), args=args,
                               train_dataset=dataset, processing_class=word_tokenizer()))
    return ours, trainer_step(trainer, trl_rows)


# -- ORPO -----------------------------------------------------------------------------------------------
def orpo_pair(folder: str, pairs: int, prompt: int, response: int):
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from astrai_pl.data.dpo import collate_pairs
    from astrai_pl.objectives import ORPO

    gen = torch.Generator().manual_seed(3)
    # responses start with a space: TRL tokenizes prompt + response as one string
    texts = [dict(prompt=text(random_ids(prompt, gen)), chosen=" " + text(random_ids(response, gen)),
                  rejected=" " + text(random_ids(response, gen))) for _ in range(pairs)]
    args = trl_args(ORPOConfig, tempfile.mkdtemp(), beta=0.1, max_length=4 * (prompt + response),
                    remove_unused_columns=False)
    args.per_device_train_batch_size = pairs
    trainer = ready(ORPOTrainer(model=hf_causal(folder), args=args, train_dataset=Dataset.from_list(texts),
                                processing_class=word_tokenizer()))
    keep = ("input_ids", "attention_mask", "labels")
    trl_rows = [{k: v for k, v in row.items() if k.endswith(keep)} for row in trainer.train_dataset]
    ours_rows = [dict(chosen_input_ids=r["chosen_input_ids"], rejected_input_ids=r["rejected_input_ids"],
                      chosen_loss_mask=[int(t != -100) for t in r["chosen_labels"]],
                      rejected_loss_mask=[int(t != -100) for t in r["rejected_labels"]],
                      prompt_length=len(r["prompt_input_ids"])) for r in trl_rows]
    width = max(len(r["chosen_input_ids"]) for r in ours_rows)
    assert width == prompt + response + 2, f"TRL made {width} tokens, not BOS + {prompt} + {response} + EOS"
    orpo = ORPO(init_from=folder, optimizer=adamw, beta=0.1).train()
    ours = objective_step(orpo, lambda: collate_pairs(ours_rows, PAD, width))
    return ours, trainer_step(trainer, trl_rows)


# -- reward model ---------------------------------------------------------------------------------------
def reward_pair(folder: str, pairs: int, prompt: int, response: int):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from astrai_pl.data.dpo import collate_pairs
    from astrai_pl.objectives import RewardModel
    from astrai_pl.objectives.reward import save_reward_model

    gen = torch.Generator().manual_seed(4)
    trl_rows = []
    for _ in range(pairs):
        shared = random_ids(prompt, gen)
        trl_rows.append({side: shared + random_ids(response, gen) for side in ("chosen_ids", "rejected_ids")})
    mask = [0] * prompt + [1] * response
    ours_rows = [dict(chosen_input_ids=r["chosen_ids"], chosen_loss_mask=mask, rejected_loss_mask=mask,
                      rejected_input_ids=r["rejected_ids"], prompt_length=prompt) for r in trl_rows]

    module = RewardModel(init_from=folder, optimizer=adamw).train()
    scorer = tempfile.mkdtemp()
    save_reward_model(module.model, scorer)
    hf = AutoModelForSequenceClassification.from_pretrained(scorer, dtype=torch.float32,
                                                            attn_implementation="sdpa")
    hf.config.pad_token_id = PAD
    args = trl_args(RewardConfig, tempfile.mkdtemp(), max_length=None, center_rewards_coefficient=None)
    args.per_device_train_batch_size = pairs
    dataset = Dataset.from_list([{k[:-4]: text(v) for k, v in r.items()} for r in trl_rows])
    trainer = ready(RewardTrainer(model=hf, args=args, train_dataset=dataset,
                                  processing_class=word_tokenizer()))
    ours = objective_step(module, lambda: collate_pairs(ours_rows, PAD, prompt + response))
    return ours, trainer_step(trainer, trl_rows)


# -- GRPO -----------------------------------------------------------------------------------------------
def even_share(prompts, completions, completion_ids, **_) -> list[float]:
    """The share of even token ids in each completion: a cheap reward with spread in every group."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def grpo_pair(folder: str, prompts: int, group: int, new_tokens: int):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from astrai_pl.data.grpo import collate_prompts
    from astrai_pl.objectives import GRPO
    from astrai_pl.tokenizer import Tokenizer

    gen = torch.Generator().manual_seed(5)
    lengths = torch.linspace(32, 64, prompts).round().int().tolist()
    prompt_ids = [random_ids(n, gen) for n in lengths]
    tok_dir = tempfile.mkdtemp()
    word_tokenizer(EOS, "left").save_pretrained(tok_dir)
    tokenizer = Tokenizer.from_pretrained(tok_dir)
    assert tokenizer.eos_token_id == EOS, tokenizer.eos_token_id
    grpo = GRPO(init_from=folder, optimizer=adamw, tokenizer=tokenizer, reward_funcs=[even_share],
                num_generations=group, max_completion_length=new_tokens, temperature=1.0, beta=0.0,
                loss_type="dapo", scale_rewards="group").train()
    opt, counts = grpo.configure_optimizers(), {}
    batch = collate_prompts([dict(prompt_ids=p) for p in prompt_ids], tokenizer)

    def ours() -> None:
        rollout = grpo.roll_out(batch, 1)
        part = rollout.micro_batches[0]
        counts["ours"] = int(part["mask"].sum())
        loss, _ = grpo._shared_step({**part, "first_pass": True}, "train")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    args = trl_args(GRPOConfig, tempfile.mkdtemp(), num_generations=group, max_completion_length=new_tokens,
                    temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", scale_rewards="group",
                    use_vllm=False, num_iterations=1, log_completions=False)
    args.per_device_train_batch_size = prompts * group
    rows = [dict(prompt=text(p)) for p in prompt_ids]
    peer_tokenizer = word_tokenizer(EOS, "left")
    assert peer_tokenizer([r["prompt"] for r in rows])["input_ids"] == prompt_ids, "TRL sees other prompts"
    trainer = ready(GRPOTrainer(model=hf_causal(folder), reward_funcs=[even_share], args=args,
                                train_dataset=Dataset.from_list(rows), processing_class=peer_tokenizer))
    trainer.model.generation_config.eos_token_id = EOS
    generation_batch = [r for r in rows for _ in range(group)]  # TRL's sampler repeats each prompt G times

    def theirs() -> None:
        trainer.training_step(trainer.model, generation_batch, None)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        counts["peer"] = int(trainer._buffered_inputs[0]["completion_mask"].sum())

    return ours, theirs, counts


CASES = {  # name: (build the pair of steps, its measure, the peer's trainer, target)
    "kto": (partial(kto_pair, examples=4, prompt=128, completion=128), "KTO step, 32-true, 4 examples x 256",
            "KTOTrainer", 1.3),
    "orpo": (partial(orpo_pair, pairs=2, prompt=128, response=128), "ORPO step, 32-true, 2 pairs x 258",
             "ORPOTrainer", 1.3),
    "reward": (partial(reward_pair, pairs=2, prompt=128, response=128),
               "Reward-model step, 32-true, 2 pairs x 256", "RewardTrainer", 1.3),
    "grpo": (partial(grpo_pair, prompts=4, group=4, new_tokens=48),
             "GRPO step (rollout + update), 32-true, 4 prompts x 4 x 48 tokens",
             "GRPOTrainer (transformers generate)", 2.0),
}


def duel_parser(description: str, cases: dict) -> argparse.ArgumentParser:
    """The options a TRL duel benchmark takes: --reps, --budget, --only (a subset of `cases`), --json."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--reps", type=int, default=5, help="timed steps per side, interleaved")
    parser.add_argument("--budget", type=float, default=45, help="seconds per objective after which no new "
                        "round starts (at least 3 rounds)")
    parser.add_argument("--only", nargs="+", choices=list(cases), default=list(cases))
    parser.add_argument("--json", default=None, help="also write the rows here")
    return parser


def main() -> None:
    args = duel_parser(__doc__.splitlines()[0], CASES).parse_args()
    setup()
    warnings.filterwarnings("ignore")
    command = command_line()
    trl = import_trl([CASES[m][1] for m in args.only], command, args.json)
    if trl is None:
        return
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        small_model().save_pretrained(folder)
        for name in args.only:
            build, measure, trainer, target = CASES[name]
            ours, theirs, *counts = build(folder)
            result = duel(ours, theirs, args.reps, budget_s=args.budget)
            if counts:  # the rollouts: both sides sampled and trained every token they were asked for
                assert counts[0]["ours"] == counts[0]["peer"] == 4 * 4 * 48, f"unequal work: {counts[0]}"
            peer = f"TRL {trl.__version__} {trainer}"
            rows.append(row_from(result, measure, peer, 1, "s/step", command, target))
            emit(rows[-1:])
    save(rows, args.json)


if __name__ == "__main__":
    main()
