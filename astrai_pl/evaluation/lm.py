"""`AstraiLM`: lm-evaluation-harness's `LM` over our inference `Engine`.

    lm = AstraiLM.from_pretrained("hf_dir/")                  # or AstraiLM(engine, tokenizer)
    lm_eval.simple_evaluate(model=lm, tasks=["astrai_arithmetic"])

Every request of a call goes to the engine at once, so continuous batching fills its steps. A continuation is
scored by `SamplingParams(max_tokens=0, prompt_logprobs=1, prompt_logprobs_start=len(context))`: the context's
K/V may come from the radix prefix cache, so the choices of one multiple-choice question prefill the
question once — the first request of each context goes ahead, the others follow it and find its pages
cached. Tokenization and truncation follow lm-eval's own `hf` model (the tokenizer's specials added unless
the text already starts with BOS, contexts cut on the left), so both score the same ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from ..inference import Engine, SamplingParams
from ..tokenizer import Tokenizer

log = logging.getLogger(__name__)

# gen_kwargs lm-eval tasks set -> the SamplingParams field they become (do_sample/temperature/until/max_gen_toks
# are handled on their own)
SAMPLING_KEYS = {"top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "seed": "seed"}
LEADER_SHARE = 4  # the leaders of one wave use at most 1/LEADER_SHARE of the KV pool, so followers find them
# New tokens per engine step when evaluating: scoring is throughput, not latency, and on CPU a forward over
# 4096 tokens takes about half the CPU time per token of the engine's interactive default (1024)
STEP_TOKENS = 4096


def widen_steps(engine: Engine) -> Engine:
    """`engine` with at least STEP_TOKENS new tokens per step (for an engine made to evaluate)."""
    engine.scheduler.max_step_tokens = max(engine.scheduler.max_step_tokens, STEP_TOKENS)
    return engine


class AstraiLM(TemplateLM):
    """lm-eval's `LM` on an `Engine` and its `Tokenizer`.

    Args:
        engine: The engine to score and generate with (its model stays as it is).
        tokenizer: The model's tokenizer.
        stop_token_ids: End ids besides the engine's own (a Hugging Face directory's generation_config.json).
        add_bos_token: None adds the tokenizer's specials (as transformers' `encode` does); True/False forces.
        max_length: Most tokens of one scored window (lm-eval's `max_length`); default: what the engine's
            context holds with the scored token.
        max_gen_toks: Most generated tokens when a task does not say.
        name: Identifies the tokenizer and template in lm-eval's request cache.
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, stop_token_ids: Sequence[int] = (),
                 add_bos_token: bool | None = None, max_length: int | None = None, max_gen_toks: int = 256,
                 name: str = "astrai"):
        super().__init__()
        room = engine.max_context - 2  # a window of max_length inputs plus its last token must be < max_context
        if max_length is not None and not 0 < max_length <= room:
            raise ValueError(f"AstraiLM.max_length={max_length}: the engine's context of {engine.max_context} "
                             f"holds windows of at most {room} tokens; pass 1..{room} or leave it unset")
        if max_gen_toks < 1:
            raise ValueError(f"AstraiLM.max_gen_toks={max_gen_toks}: generate at least one token")
        self.engine, self.tokenizer = engine, tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.add_bos_token, self._max_length, self._max_gen_toks = add_bos_token, max_length or room, max_gen_toks
        self.name = name

    @classmethod
    def from_pretrained(cls, model: str, adapter: str | None = None, *, tokenizer: str | None = None,
                        device: str | None = None, dtype: str | None = None, max_total_tokens: int | None = None,
                        **options: Any) -> AstraiLM:
        """The engine on a Hugging Face directory or a checkpoint (`--model` of `astrai-pl generate`), with a
        PEFT adapter merged in, as `astrai-pl generate` loads it; `options` go to AstraiLM."""
        from argparse import Namespace

        from ..commands import load_engine

        ns = Namespace(model=str(model), adapter=adapter, tokenizer=tokenizer, device=device, dtype=dtype,
                       max_total_tokens=max_total_tokens)
        engine, tok, eos_ids = load_engine(ns)
        return cls(widen_steps(engine), tok, stop_token_ids=eos_ids, name=options.pop("name", str(model)), **options)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> AstraiLM:
        """`lm_eval --model astrai --model_args pretrained=DIR,adapter=DIR,dtype=bfloat16`."""
        args = simple_parse_args_string(arg_string)
        return cls.create_from_arg_obj(args, additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> AstraiLM:
        args = dict(arg_dict)
        path = args.pop("pretrained", None) or args.pop("model", None)
        if path is None:
            raise ValueError("--model_args needs pretrained=DIR_OR_CKPT (a Hugging Face directory or a checkpoint)")
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "device" in extra and "device" not in args:
            args["device"] = extra["device"]
        return cls.from_pretrained(path, **args)  # batch sizes do not apply: the engine batches every request

    # -- what lm-eval asks of a model ---------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: BOS, else the end of text (as lm-eval's `hf` model)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as text through the tokenizer's chat template; without the generation prompt the
        last message is left open (lm-eval continues it, as transformers' `continue_final_message`)."""
        text = self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        if not add_generation_prompt and chat_history:
            last = chat_history[-1]["content"]
            end = text.rfind(last)
            text = text[:end + len(last)] if end >= 0 and last else text
        return text

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            bos = self.tokenizer.bos_token
            starts_with_bos = bos is not None and string.startswith(bos)
            add_special_tokens = False if starts_with_bos else (True if self.add_bos_token is None
                                                                 else self.add_bos_token)
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- scoring ----------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether the continuation is the greedy one) per request.
        A window longer than `max_length` + 1 keeps its last tokens, as lm-eval's `hf` model does."""
        windows = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval asked to score an empty continuation; the task's doc_to_choice or "
                                 "doc_to_target gives an empty string")
            ids = (context + continuation)[-(self.max_length + 1):]
            windows.append((ids, max(1, len(ids) - len(continuation))))
        results = self.score_windows(windows)
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def score_windows(self, windows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For each (ids, start): the summed log-probability of ids[start:] after ids[:start], and whether every
        one of those tokens is the likeliest there."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (ids, start) in enumerate(windows):
            groups.setdefault(tuple(ids[:start]), []).append(i)
        results: list[tuple[float, bool] | None] = [None] * len(windows)
        for leaders, followers in self._waves(list(groups.values()), windows):
            for wave in (leaders, followers):
                if not wave:
                    continue
                params = [SamplingParams(max_tokens=0, prompt_logprobs=1, prompt_logprobs_start=windows[i][1])
                          for i in wave]
                for i, out in zip(wave, self.engine.generate([windows[i][0] for i in wave], params)):
                    results[i] = _sum_and_greedy(windows[i][0], windows[i][1], out.prompt_logprobs)
        return results

    def _waves(self, groups: list[list[int]], windows: list[tuple[list[int], int]]):
        """(leaders, followers) per wave: the first request of each context, then the rest. A wave's leaders
        take at most a share of the KV pool, so their context pages are still cached when the followers run."""
        usage = self.engine.usage()
        budget = max(1, usage.total * usage.page_size // LEADER_SHARE)
        wave: list[list[int]] = []
        tokens = 0
        for group in groups:
            size = len(windows[group[0]][0])
            if wave and tokens + size > budget:
                yield [g[0] for g in wave], [i for g in wave for i in g[1:]]
                wave, tokens = [], 0
            wave.append(group)
            tokens += size
        if wave:
            yield [g[0] for g in wave], [i for g in wave for i in g[1:]]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, over disjoint windows of `max_length` tokens each scored
        with as much of the text before it as fits (lm-eval's rolling windows, one token of context)."""
        windows, owners = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((context + continuation, len(context)))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, self.score_windows(windows)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation -------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued until one of its `until` strings, an end id or `max_gen_toks`; the text is cut
        before the first stop string. Greedy unless the task asks for sampling (do_sample with a temperature)."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise ValueError(f"generation_kwargs max_gen_toks={max_gen_toks} leaves no room for the prompt in "
                                 f"max_length={self.max_length}; lower it")
            prompts.append(self.tok_encode(context, left_truncate_len=self.max_length - max_gen_toks))
            params.append(self._sampling(kwargs, until, max_gen_toks))
            stops.append(until)
        outs = self.engine.generate(prompts, params) if prompts else []
        texts = []
        for req, out, until in zip(requests, outs, stops):
            text = postprocess_generated_text(out.text, until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts

    def _sampling(self, kwargs: dict[str, Any], until: list[str], max_gen_toks: int) -> SamplingParams:
        do_sample, temperature = kwargs.pop("do_sample", False), kwargs.pop("temperature", 0.0)
        fields = {SAMPLING_KEYS[k]: kwargs.pop(k) for k in list(kwargs) if k in SAMPLING_KEYS}
        if kwargs:
            log.warning("generation_kwargs %s have no counterpart in SamplingParams; ignored", sorted(kwargs))
        return SamplingParams(max_tokens=max_gen_toks, temperature=float(temperature) if do_sample else 0.0,
                              stop=[s for s in until if s], stop_token_ids=self.stop_token_ids, **fields)


def _sum_and_greedy(ids: list[int], start: int, scored) -> tuple[float, bool]:
    total, greedy = 0.0, True
    for position in range(start, len(ids)):
        logprob, alternatives = scored[position]
        total += logprob
        greedy = greedy and alternatives[0][0] == ids[position]
    return total, greedy


register_model("astrai")(AstraiLM)
