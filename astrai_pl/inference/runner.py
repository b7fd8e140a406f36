"""One forward over a step's plan: every scheduled token of every request in a single (1, T) row.

Decodes come first, then prefill chunks; the `StepView` tells each attention layer where every
request's tokens start and which slots hold its context. Only the rows whose next token is sampled go
through the output projection. On CPU every Linear multiplies by an (in, out) copy of its weight
(`InputMajorWeights`, remade when the weights change): the fast layout for the few rows of a decode.
When the engine has recorded decode steps (`graphs`, decode_graphs.py), a step of plain decodes replays one.
"""

from __future__ import annotations

import torch

from ..model.layers import InputMajorWeights, Linear
from .adapters import step_rows
from .attention import StepView, model_features, select_backend
from .attention.cpu_decode import CpuDecode
from .decode_graphs import DecodeGraphs, RecordingFailed
from .pool import KVPool
from .request import Request
from .sampling import scored

_SCORE_ELEMENTS = 1 << 22  # logits per output projection of scored prompt positions (prompt_logprobs): 16 MB


class ModelRunner:
    def __init__(self, model, pool: KVPool, device: torch.device, dtype: torch.dtype):
        self.model, self.pool, self.device, self.dtype = model, pool, device, dtype
        self.steps = 0
        self.scratch: dict = {}  # attention backends' state between steps
        self.weights = InputMajorWeights() if device.type == "cpu" else None
        self.needs = model_features(model.config)  # what the attention backend must do for this model
        # decode steps of a Llama-shaped model on CPU: one kernel call for all layers (attention/cpu_decode.py)
        self.cpu_decode = CpuDecode.for_model(model) if device.type == "cpu" else None
        self.graphs: DecodeGraphs | None = None  # decode steps replayed from recordings (decode_graphs.py)

    def forward(self, plan: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor | None]:
        """Compute `n` tokens of each planned request; the requests now ready to sample and their logits.

        Advances each request's `num_computed` (and its req_to_token row). Logits are float32 (N, V): one row per
        ready request, or 1 + len(draft) rows for a request with a draft (its draft computed after its tokens).
        """
        if not plan:
            return [], None
        plan = sorted(plan, key=lambda item: item[1] != 1)  # decodes first, order otherwise kept
        graphed = self._graphed(plan)
        ids, positions, out_slots = self._write_table(plan)
        if graphed is not None:
            try:
                return self._replay(plan, ids, positions, out_slots, kernel=graphed)
            except RecordingFailed:
                pass  # logged once; this and every later step run eagerly
        view = StepView.build(
            self.pool.storage,
            self.pool.req_to_token.table,
            select_backend(self.device, self.dtype, self.needs),
            rows=[req.row for req, _ in plan],
            prefix_lens=[req.num_computed for req, _ in plan],
            extend_lens=[n for _, n in plan],
            out_slots=out_slots,
            page_size=self.pool.page_size,
            keys=tuple(req.id for req, _ in plan),
            step=self.steps,
            scratch=self.scratch,
        )
        self.steps += 1
        input_ids = torch.tensor(ids, device=self.device)[None]
        position_ids = torch.tensor(positions, device=self.device)[None]
        lengths = {}  # longrope: a token's angles follow its request's whole length, prompt chunks included
        if getattr(getattr(self.model, "rotary", None), "per_sequence", False):
            lengths["sequence_lengths"] = torch.tensor([len(req.tokens) for req, n in plan for _ in range(n)],
                                                       device=self.device)[None]
        with Linear.input_major(self.weights), step_rows(self.model, plan):
            hidden = None
            if self.cpu_decode is not None:  # None for longrope models, the ones with `lengths`
                hidden = self.cpu_decode.hidden_states(input_ids, position_ids, view, self.weights)
            if hidden is None:
                hidden, _ = self.model.hidden_states(input_ids, position_ids=position_ids, cache=view, **lengths)
            ready, sample_at, end, scored_rows = [], [], 0, []
            for req, n in plan:
                at = end - req.num_computed
                positions = req.scored_positions(req.num_computed, req.num_computed + n)
                scored_rows += [(req, p, at + p) for p in positions]
                req.num_computed += n
                req.table_len = req.num_computed
                end += n
                if req.num_computed == len(req.tokens) + len(req.draft):  # a draft's rows too (speculative.py)
                    ready.append(req)
                    sample_at.extend(range(end - 1 - len(req.draft), end))
            self._score_prompts(hidden[0], scored_rows)
            if not ready:
                return [], None
            return ready, self.model.lm_head(hidden[0, sample_at]).float()

    def _graphed(self, plan: list[tuple[Request, int]]) -> bool | None:
        """Whether a recorded decode step runs this plan: None (run it eagerly), else whether its attention is the
        fused kernel's. Only plain decodes qualify: one token each, the last before sampling, none scored."""
        if self.graphs is None:
            return None
        if not all(n == 1 and req.remaining == 1 and not req.scored_positions(req.num_computed, req.num_computed + 1)
                   for req, n in plan):  # fmt: skip
            return None
        kernel = select_backend(self.device, self.dtype, self.needs).name == "cuda"
        return kernel if self.graphs.usable(len(plan), kernel) else None

    def _replay(self, plan, ids, positions, out_slots, kernel: bool) -> tuple[list[Request], torch.Tensor]:
        rows = [req.row for req, _ in plan]
        kv_lens = [req.num_computed + 1 for req, _ in plan]
        with Linear.input_major(self.weights):
            logits = self.graphs.run(ids, positions, out_slots, rows, kv_lens, kernel)
        self.steps += 1  # a backend's state kept from an eager step does not follow this one
        for req, _ in plan:
            req.num_computed += 1
            req.table_len = req.num_computed
        return [req for req, _ in plan], logits

    def _score_prompts(self, hidden: torch.Tensor, rows: list[tuple[Request, int, int]]) -> None:
        """Each (request, prompt position, hidden row): the log-probability of the prompt's next token there,
        for every request of the step together, through the output projection a bounded block of rows at a
        time (a block's (rows, vocab) logits stay near _SCORE_ELEMENTS)."""
        block = max(1, _SCORE_ELEMENTS // self.model.config.vocab_size)
        for lo in range(0, len(rows), block):
            part = rows[lo : lo + block]
            at = torch.tensor([row for _, _, row in part], device=hidden.device)
            nexts = torch.tensor([req.tokens[p + 1] for req, p, _ in part], device=hidden.device)
            tops = [req.params.prompt_logprobs for req, _, _ in part]
            chosen, top = scored(self.model.lm_head(hidden[at]), nexts, tops)
            for i, (req, p, _) in enumerate(part):
                req.prompt_logprobs[p + 1] = (chosen[i], top[i] if top is not None else [])

    def forget_step_state(self) -> None:
        """Drop what attention backends carry from step to step (after a step that failed half-way)."""
        self.scratch.pop("decode_mirror", None)
        self.scratch.pop("decode_batch", None)

    def _write_table(self, plan: list[tuple[Request, int]]) -> tuple[list[int], list[int], list[int]]:
        """Fill each request's req_to_token row up to its new tokens; the step's ids, positions and slots."""
        ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        rows: list[int] = []
        table_pos: list[int] = []
        table_slots: list[int] = []
        for req, n in plan:
            start, stop = req.num_computed, req.num_computed + n
            slots = self.pool.slots(req.pages, req.table_len, stop)
            rows += [req.row] * len(slots)
            table_pos += range(req.table_len, stop)
            table_slots += slots
            out_slots += slots[len(slots) - n :]
            ids += (req.tokens + req.draft if req.draft else req.tokens)[start:stop]
            positions += range(start, stop)
        self.pool.req_to_token.write(rows, table_pos, table_slots)
        return ids, positions, out_slots
