import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from fit_runs import quiet_trainer

from astrai_pl.checkpoint import load_transformer
from astrai_pl.cli import lightning_main, main
from astrai_pl.data import Arithmetic, DataError, SFTData
from astrai_pl.data.synthetic import problems
from astrai_pl.model import ModelConfig
from astrai_pl.objectives import SFT, Pretrain, greedy_accuracy
from astrai_pl.objectives.evaluation import chat_prompts, greedy_decode
from astrai_pl.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
DEBUG_CONFIG = ROOT / "configs" / "sft" / "debug.yaml"


def trainer(**kw):
    return quiet_trainer(devices=1, **kw)


def uneven_rows(path, n=24):
    """Prompt/completion rows whose completions range from 1 to 40 characters: very uneven trained counts."""
    rows = [
        {"prompt": f"Item {i}:", "completion": " " + "abcdefgh"[i % 8] * (1 + (7 * i) % 40)} for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def pad_cat(batches, pad_id):
    """One batch of the union of micro-batches, right-padded to one width (padding is its own document)."""
    width = max(b["input_ids"].shape[1] for b in batches)
    out = {}
    for key in ("input_ids", "labels", "document_ids", "position_ids"):
        parts = []
        for b in batches:
            t, extra = b[key], width - b[key].shape[1]
            if key in ("input_ids", "labels"):
                pad = torch.full((t.shape[0], extra), pad_id if key == "input_ids" else -100)
            elif key == "document_ids":
                pad = (t[:, -1:] + 1).expand(-1, extra)
            else:
                pad = t[:, -1:] + 1 + torch.arange(extra)
            parts.append(torch.cat([t, pad], dim=1))
        out[key] = torch.cat(parts)
    return out


class GradientRecorder(L.Callback):
    def __init__(self):
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})


def gradients(module, batch):
    module.zero_grad()
    loss, _ = module._shared_step(batch, "train")
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def relative_error(grads, reference):
    worst = max(float((grads[n] - reference[n]).abs().max()) for n in reference)
    return worst / max(float(g.abs().max()) for g in reference.values())


@pytest.mark.parametrize("limit", [None, 5], ids=["short-window-at-epoch-end", "short-window-at-limit"])
def test_accumulation_equals_one_batch_of_the_union(tmp_path, limit):
    k = 3
    data = SFTData(
        path=uneven_rows(tmp_path / "rows.jsonl"),
        sections="prompt_completion",
        packing="none",
        max_seq_len=64,
        batch_size=2,
        val_fraction=0.25,
    )
    torch.manual_seed(0)
    arch = ModelConfig.from_name("debug", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    module = SFT(arch=arch, optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    recorder = GradientRecorder()
    run = trainer(
        max_epochs=1,
        accumulate_grad_batches=k,
        precision="64-true",
        limit_val_batches=0,
        limit_train_batches=limit or 1.0,
        callbacks=[recorder],
    )
    run.fit(module, datamodule=data)

    data.trainer = None  # the same shuffle, untagged: the micro-batches Lightning saw
    batches = list(data.train_dataloader())[:limit]
    windows = [batches[i : i + k] for i in range(0, len(batches), k)]
    assert len(batches) % k != 0 and len(recorder.steps) == len(windows)
    for window, recorded in zip(windows, recorder.steps):
        counts = [int((b["labels"][:, 1:] != -100).sum()) for b in window]
        assert len(window) == 1 or len(set(counts)) > 1  # uneven trained tokens per micro-batch
        union = gradients(module, pad_cat(window, data.tokenizer.pad_token_id))
        assert relative_error(recorded, union) < 1e-6
        # what Lightning alone would give: the mean of per-micro-batch means, each divided by k
        micro = [gradients(module, b) for b in window]
        naive = {n: sum(g[n] for g in micro) / k for n in union}
        assert relative_error(naive, union) > 1e-2


def test_the_loss_is_the_mean_over_trained_tokens_and_ignores_the_prompt():
    torch.manual_seed(0)
    module = SFT(arch=ModelConfig.from_name("debug"))
    ids = torch.randint(5, 300, (2, 12))
    labels = torch.full_like(ids, -100)
    labels[0, 8:], labels[1, 5:7] = ids[0, 8:], ids[1, 5:7]  # "completions": 4 and 2 tokens
    hidden, _ = module.model.hidden_states(ids)
    hidden = hidden.detach().requires_grad_(True)  # a leaf: its gradient shows which positions count
    module.model.hidden_states = lambda *a, **kw: (hidden, None)
    loss, metrics = module._shared_step({"input_ids": ids, "labels": labels}, "train")
    logits = module.model.lm_head(hidden)
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
    trained = labels[:, 1:] != -100
    torch.testing.assert_close(loss, per_token[trained].mean())
    assert int(metrics["tokens"]) == 6
    loss.backward()
    prompt_positions = ~torch.cat([trained, torch.zeros(2, 1, dtype=torch.bool)], dim=1)
    assert (hidden.grad[prompt_positions] == 0).all() and (hidden.grad[~prompt_positions] != 0).any()


def test_sft_fast_dev_run_on_the_synthetic_task(tmp_path):
    data = SFTData(
        synthetic=Arithmetic(train_rows=200, test_rows=20),
        max_seq_len=64,
        batch_size=4,
        cache_dir=str(tmp_path),
    )
    module = SFT(arch=ModelConfig.from_name("debug"), tokenizer=data.tokenizer)
    trainer(fast_dev_run=2, accumulate_grad_batches=2).fit(module, datamodule=data)


def test_init_from_a_pretrain_checkpoint_and_the_checkpoint_records_the_shape(tmp_path):
    torch.manual_seed(0)
    arch = ModelConfig.from_name("debug", hidden_size=32, intermediate_size=64)
    source = Pretrain(arch=arch)
    checkpoint = {"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams)}
    source.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "pre.ckpt")
    module = SFT(init_from=str(tmp_path / "pre.ckpt"))
    ids = torch.randint(0, 320, (1, 8))
    torch.testing.assert_close(module.model(ids).logits, source.model(ids).logits)
    saved = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(saved)  # arch was None (init_from): the shape is recorded all the same
    torch.save(saved, tmp_path / "sft.ckpt")
    assert load_transformer(None, str(tmp_path / "sft.ckpt")).config.hidden_size == 32


def test_batched_greedy_decoding_equals_one_prompt_at_a_time():
    torch.manual_seed(0)
    model = SFT(arch=ModelConfig.from_name("debug")).model.double()
    tok = Tokenizer.byte_level()
    prompts = chat_prompts(["What is 1 + 2?", "What is 10 - 42?", "Hi"], tok)
    assert len({len(p) for p in prompts}) == 3  # left padding is exercised
    batched = greedy_decode(model, prompts, tok.eos_token_ids, tok.pad_token_id, 6)
    single = [greedy_decode(model, [p], tok.eos_token_ids, tok.pad_token_id, 6)[0] for p in prompts]
    assert batched == single
    accuracy = greedy_accuracy(model, tok, problems(10, "test"), max_new_tokens=3)
    assert 0.0 <= accuracy <= 0.2  # an untrained model answers almost nothing right


def broken_rows(tmp_path):
    rows = [
        json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
        )
    ]
    (tmp_path / "rows.jsonl").write_text("\n".join([rows[0], rows[0], '{"messages": [', rows[0]]) + "\n")


def test_fit_stops_before_the_first_step_naming_the_file_and_line(tmp_path, monkeypatch):
    broken_rows(tmp_path)
    monkeypatch.chdir(tmp_path)
    cli = lightning_main(
        ["--config", str(DEBUG_CONFIG), "--data.init_args.path", "rows.jsonl", "--trainer.logger", "false"],
        run=False,
    )
    with pytest.raises(DataError, match=r"rows\.jsonl, line 3: malformed JSON"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 0
    assert cli.trainer.fit_loop.epoch_loop.batch_progress.total.ready == 0


def test_the_command_line_names_the_file_and_line(tmp_path, monkeypatch):
    """`astrai-pl fit --config configs/sft/debug.yaml --data.init_args.path rows.jsonl` exits with one line."""
    broken_rows(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(DEBUG_CONFIG), "--data.init_args.path", "rows.jsonl"])
    message = str(exit_.value.code)
    assert message.startswith("astrai-pl: rows.jsonl, line 3: malformed JSON") and "Fix:" in message
    assert not list((tmp_path / "runs" / "sft-debug").glob("**/checkpoints"))
