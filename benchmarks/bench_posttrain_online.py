"""Distill, Online DPO, RLOO and GRPO (sequence-level ratios) steps against TRL's GKDTrainer, OnlineDPOTrainer,
RLOOTrainer and GRPOTrainer.

Same setting as bench_posttrain_more.py (its helpers): the `small` preset (~31M parameters) saved with our
save_pretrained and loaded by `transformers` for TRL, float32, 2 threads, the same prompts on both sides, one
optimizer step of fused AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1) per repetition; logging, schedulers
and clipping left out on both sides. Every step samples its own completions: TRL with transformers' `generate`
(use_vllm False), ours with our Engine. Both tokenizers' end-of-sequence id is 8192, outside the model's
8192-token vocabulary, so no completion stops early and both sides sample and train exactly the same number
of tokens (checked after each duel). Our steps call the objective's rollout / `_shared_step` directly (without
a Lightning Trainer there is nothing to log to); TRL's call `training_step` on the trainer, as its loop does.

- Distill vs GKD: 4 prompts of 32..64 tokens, lmbda 1 (every step on-policy: the student samples 48 tokens at
  temperature 0.9), beta 0.5 (the generalised JSD), a teacher of the same shape with other weights.
- Online DPO: 4 prompts, two completions of 48 tokens each at temperature 0.9, ranked by `even_share`, sigmoid
  loss, beta 0.1, a live frozen reference on both sides.
- RLOO: 4 prompts x num_generations 4, max_completion_length 48, temperature 1, beta 0 (no reference model on
  either side), one optimizer step per rollout (TRL: per_device_train_batch_size 16, steps_per_generation 1).
- GRPO with importance_sampling_level 'sequence' (GSPO): as bench_posttrain_more.py's GRPO duel (4 prompts x 4 x
  48 tokens, beta 0, loss 'dapo'), with sequence-level ratios on both sides.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_posttrain_online.py [--only distill online-dpo rloo gspo]
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_posttrain_online.py --dry-run   # debug preset, 2 x 8 tokens

TRL's GKD collator (DataCollatorForChatML) needs a chat template, which the word-level tokenizer has not: its
step gets the left-padded prompts as that collator gives them, built here.
"""

from __future__ import annotations

import random
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_posttrain import adamw, import_trl, random_ids, ready, trl_args  # noqa: E402
from bench_posttrain_more import EOS, duel_parser, even_share, hf_causal, text, word_tokenizer  # noqa: E402
from harness import command_line, duel, duels, emit, row_from, save, setup  # noqa: E402


def model(preset: str, seed: int):
    """A fresh model of `preset` with the word tokenizer's 8192 ids (`small`: as harness.small_model)."""
    from astrai_pl.model import ModelConfig, Transformer

    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_name(preset, vocab_size=8192))


def prompts_and_tokenizer(prompts: int, seed: int):
    """`prompts` random prompts of 32..64 tokens, our Tokenizer over the word tokenizer (end id 8192) and
    TRL's (left padding), checked to give the same ids."""
    from astrai_pl.tokenizer import Tokenizer

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(32, 64, prompts).round().int().tolist()
    prompt_ids = [random_ids(n, gen) for n in lengths]
    folder = tempfile.mkdtemp()
    word_tokenizer(EOS, "left").save_pretrained(folder)
    ours = Tokenizer.from_pretrained(folder)
    peer = word_tokenizer(EOS, "left")
    assert ours.eos_token_id == EOS and peer([text(p) for p in prompt_ids])["input_ids"] == prompt_ids
    return prompt_ids, ours, peer


def stop_only_at_eos(trainer) -> None:
    """TRL's generation stops at id 8192 alone (the saved config's end id would otherwise join it)."""
    trainer.model.generation_config.eos_token_id = EOS
    if hasattr(trainer, "eos_token_ids"):
        trainer.eos_token_ids = [EOS]
    config = getattr(trainer, "generation_config", None)
    if config is not None and hasattr(config, "eos_token_id"):
        config.eos_token_id = EOS


def optimizer_step(module, loss: torch.Tensor, opt) -> None:
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def peer_step(trainer, inputs) -> torch.Tensor:
    """TRL's training_step (forward, loss, backward) and one optimizer step."""
    loss = trainer.training_step(trainer.model, inputs, None)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss


# -- Distill vs GKD --------------------------------------------------------------------------------------
def distill_pair(folder: str, teacher: str, prompts: int, new_tokens: int):
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from astrai_pl.data.grpo import collate_prompts
    from astrai_pl.objectives import Distill

    prompt_ids, tokenizer, peer_tokenizer = prompts_and_tokenizer(prompts, seed=6)
    distill = Distill(init_from=folder, teacher_model=teacher, optimizer=adamw, tokenizer=tokenizer, lmbda=1.0,
                      beta=0.5, temperature=0.9, max_new_tokens=new_tokens).train()
    opt, counts = distill.configure_optimizers(), {}
    batch = collate_prompts([dict(prompt_ids=p) for p in prompt_ids], tokenizer)

    def ours() -> None:
        loss, metrics = distill._shared_step(batch, "train")
        counts["ours"] = int(metrics["tokens"].round())
        optimizer_step(distill, loss, opt)

    args = trl_args(GKDConfig, tempfile.mkdtemp(), lmbda=1.0, beta=0.5, temperature=0.9, max_new_tokens=new_tokens,
                    max_length=None)
    args.per_device_train_batch_size = prompts
    rows = Dataset.from_list([dict(messages=[{"role": "user", "content": text(p)}]) for p in prompt_ids])
    trainer = ready(GKDTrainer(model=hf_causal(folder), teacher_model=hf_causal(teacher), args=args,
                               train_dataset=rows, processing_class=peer_tokenizer))
    stop_only_at_eos(trainer)
    width = max(map(len, prompt_ids))  # left-padded prompts, as GKD's collator gives them
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    attention = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompt_ids])[:, None]).long()

    def theirs() -> None:
        inputs = {"prompts": ids, "prompt_attention_mask": attention, "input_ids": ids, "attention_mask": attention,
                  "labels": ids}
        random.seed(0)  # lmbda 1: always on-policy
        peer_step(trainer, inputs)
        counts["peer"] = int((inputs["labels"] != -100).sum())

    return ours, theirs, counts, prompts * new_tokens


# -- Online DPO ------------------------------------------------------------------------------------------
def online_dpo_pair(folder: str, prompts: int, new_tokens: int):
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from astrai_pl.data.grpo import collate_prompts
    from astrai_pl.objectives import OnlineDPO

    prompt_ids, tokenizer, peer_tokenizer = prompts_and_tokenizer(prompts, seed=7)
    online = OnlineDPO(init_from=folder, optimizer=adamw, tokenizer=tokenizer, reward_funcs=[even_share], beta=0.1,
                       loss_type="sigmoid", max_new_tokens=new_tokens, temperature=0.9).train()
    opt, counts = online.configure_optimizers(), {}
    batch = collate_prompts([dict(prompt_ids=p) for p in prompt_ids], tokenizer)
    real_sample = online.sample_pairs

    def counted_sample(b):
        pairs = real_sample(b)
        counts["ours"] = int(pairs["mask"].sum())
        return pairs

    online.sample_pairs = counted_sample

    def ours() -> None:
        optimizer_step(online, online._shared_step(batch, "train")[0], opt)

    args = trl_args(OnlineDPOConfig, tempfile.mkdtemp(), beta=0.1, loss_type="sigmoid", max_new_tokens=new_tokens,
                    temperature=0.9, use_vllm=False, max_length=4096)
    args.per_device_train_batch_size = prompts
    rows = [dict(prompt=text(p)) for p in prompt_ids]
    trainer = ready(OnlineDPOTrainer(model=hf_causal(folder), ref_model=hf_causal(folder).eval(),
                                     reward_funcs=[even_share], args=args, train_dataset=Dataset.from_list(rows),
                                     processing_class=peer_tokenizer))
    stop_only_at_eos(trainer)
    real_generate = trainer._generate

    def counted_generate(*a, **k):
        out = real_generate(*a, **k)
        counts["peer"] = int(out[3].sum())  # the completion mask of the 2P samples
        return out

    trainer._generate = counted_generate

    def theirs() -> None:
        peer_step(trainer, {"prompt": [r["prompt"] for r in rows]})

    return ours, theirs, counts, 2 * prompts * new_tokens


# -- RLOO and GRPO (sequence-level ratios) ---------------------------------------------------------------
def rollout_pair(folder: str, kind: str, prompts: int, group: int, new_tokens: int):
    """Our RLOO or GRPO (importance_sampling_level 'sequence') and TRL's trainer of the same name."""
    from datasets import Dataset

    from astrai_pl.data.grpo import collate_prompts
    from astrai_pl.objectives import GRPO, RLOO

    prompt_ids, tokenizer, peer_tokenizer = prompts_and_tokenizer(prompts, seed=8)
    common = dict(num_generations=group, max_completion_length=new_tokens, temperature=1.0, beta=0.0)
    if kind == "rloo":
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer

        module = RLOO(init_from=folder, optimizer=adamw, tokenizer=tokenizer, reward_funcs=[even_share], **common)
        extra = {}
    else:
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer

        extra = dict(loss_type="dapo", scale_rewards="group", importance_sampling_level="sequence")
        module = GRPO(init_from=folder, optimizer=adamw, tokenizer=tokenizer, reward_funcs=[even_share], **common,
                      **extra)
    module.train()
    opt, counts = module.configure_optimizers(), {}
    batch = collate_prompts([dict(prompt_ids=p) for p in prompt_ids], tokenizer)

    def ours() -> None:
        part = module.roll_out(batch, 1).micro_batches[0]
        counts["ours"] = int(part["mask"].sum())
        optimizer_step(module, module._shared_step({**part, "first_pass": True}, "train")[0], opt)

    args = trl_args(Config, tempfile.mkdtemp(), **common, top_p=1.0, top_k=0, use_vllm=False, num_iterations=1,
                    log_completions=False, **extra)
    args.per_device_train_batch_size = prompts * group
    rows = [dict(prompt=text(p)) for p in prompt_ids]
    trainer = ready(Trainer(model=hf_causal(folder), reward_funcs=[even_share], args=args,
                            train_dataset=Dataset.from_list(rows), processing_class=peer_tokenizer))
    stop_only_at_eos(trainer)
    generation_batch = [r for r in rows for _ in range(group)]  # TRL's sampler repeats each prompt G times

    def theirs() -> None:
        peer_step(trainer, generation_batch)
        counts["peer"] = int(trainer._buffered_inputs[0]["completion_mask"].sum())

    return ours, theirs, counts, prompts * group * new_tokens


CASES = {  # name: (its pair of steps from (student, teacher, prompts, group, new_tokens), measure, peer, target)
    "distill": (lambda f, t, p, g, n: distill_pair(f, t, p, n),
                "Distill step (on-policy sample + JSD update), 32-true, {p} prompts x {n} tokens",
                "GKDTrainer (transformers generate)", 1.3),
    "online-dpo": (lambda f, t, p, g, n: online_dpo_pair(f, p, n),
                   "Online DPO step (2 samples + update), 32-true, {p} prompts x 2 x {n} tokens",
                   "OnlineDPOTrainer (transformers generate)", 1.3),
    "rloo": (lambda f, t, p, g, n: rollout_pair(f, "rloo", p, g, n),
             "RLOO step (rollout + update), 32-true, {p} prompts x {g} x {n} tokens",
             "RLOOTrainer (transformers generate)", 1.3),
    "gspo": (lambda f, t, p, g, n: rollout_pair(f, "gspo", p, g, n),
             "GRPO importance_sampling_level=sequence step (rollout + update), 32-true, {p} prompts x {g} x {n} tokens",
             "GRPOTrainer (transformers generate)", 1.3),
}
SIZES = {"small": (4, 4, 48), "debug": (2, 2, 8)}  # prompts, group, new tokens


def main(argv: list[str] | None = None) -> int:
    parser = duel_parser(__doc__.splitlines()[0], CASES)
    parser.add_argument("--dry-run", action="store_true", help="the `debug` preset, 2 prompts x 8 tokens, 1 round, "
                        "no warm-up: checks that every duel runs and does equal work (its ratios mean nothing)")
    args = parser.parse_args(argv)
    setup()
    warnings.filterwarnings("ignore")
    command = command_line()
    preset = "debug" if args.dry_run else "small"
    p, g, n = SIZES[preset]
    measures = {name: CASES[name][1].format(p=p, g=g, n=n) for name in args.only}
    trl = import_trl(list(measures.values()), command, args.json)
    if trl is None:
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as teacher:
        model(preset, seed=0).save_pretrained(folder)
        model(preset, seed=1).save_pretrained(teacher)
        for name in args.only:
            build, _, trainer, target = CASES[name]
            ours, theirs, counts, expected = build(folder, teacher, p, g, n)
            if args.dry_run:
                result = duels({"ours": ours, "peer": theirs}, 1, warmup=0, min_reps=1)["peer"]
            else:
                result = duel(ours, theirs, args.reps, budget_s=args.budget)
            assert counts["ours"] == counts["peer"] == expected, f"{name}: unequal work {counts}, {expected} asked"
            rows.append(row_from(result, measures[name], f"TRL {trl.__version__} {trainer}", 1, "s/step", command, target))
            emit(rows[-1:])
    save(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
