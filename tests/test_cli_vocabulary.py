"""A tokenizer with more ids than the model's embedding has rows is refused before anything runs: by `fit` before
a corpus is tokenized, naming both sizes and the option that fixes it, and by `generate`/`chat` on loading."""

import itertools
from pathlib import Path

import pytest
from test_commands import model_dir, tokenizer  # noqa: F401  (the debug model saved with the byte tokenizer)

from astrai_pl.commands import chat_verb, generate_verb
from astrai_pl.tokenizer import train_bpe
from astrai_pl.verbs import main

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["".join(letters) for letters in itertools.product("abcdefghij", repeat=3)]  # enough pairs to merge


@pytest.fixture(scope="module")
def large_tokenizer(tmp_path_factory):
    """A trained BPE tokenizer of 400 ids, more than the debug preset's 320."""
    folder = tmp_path_factory.mktemp("tok400")
    trained = train_bpe([" ".join(WORDS[i:i + 20]) for i in range(0, len(WORDS), 20)], 400, min_frequency=1)
    trained.save_pretrained(folder)
    return folder, trained.vocab_size


@pytest.mark.parametrize("config", ["pretrain/debug.yaml", pytest.param("sft/debug.yaml", marks=pytest.mark.slow)])
def test_fit_refuses_a_larger_tokenizer_before_tokenizing(large_tokenizer, tmp_path, config):
    folder, n = large_tokenizer
    assert n > 320
    cache = tmp_path / "cache"
    args = ["fit", "--config", str(ROOT / "configs" / config), "--data.init_args.tokenizer", str(folder),
            "--data.init_args.cache_dir", str(cache), "--trainer.default_root_dir", str(tmp_path),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
    with pytest.raises(SystemExit) as stop:
        main(args)
    message = str(stop.value.code)
    assert f"has {n} ids but the model's vocab_size is 320" in message
    assert f"--model.init_args.arch.vocab_size {-(-n // 64) * 64}" in message
    assert not (cache / "pretrain").exists()  # refused before the corpus was tokenized


@pytest.mark.parametrize("verb", [generate_verb, chat_verb])
def test_generate_and_chat_refuse_a_tokenizer_larger_than_the_model(model_dir, large_tokenizer, verb):  # noqa: F811
    folder, n = large_tokenizer
    extra = ["--prompt", "hi"] if verb is generate_verb else []
    with pytest.raises(SystemExit, match=rf"the tokenizer has {n} ids but .* only 320; pass the tokenizer the model "
                                         r"was trained with \(--tokenizer DIR\)"):
        verb(["--model", str(model_dir), "--tokenizer", str(folder), *extra])
