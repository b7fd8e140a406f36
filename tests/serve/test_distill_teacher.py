"""Distill's teacher behind a server: `astrai-pl serve`'s routes on a loopback port answer the top-k
log-probabilities of every token by id, and the divergence over them is the one on the same model's own
top-k, read locally."""

import pytest
import torch
import torch.nn.functional as F
from served import MODEL

from astrai_pl.data.packing import IGNORE_INDEX
from astrai_pl.model import Transformer
from astrai_pl.objectives import Distill
from astrai_pl.objectives.evaluation import chat_prompts
from astrai_pl.objectives.on_policy_losses import topk_generalized_jsd_loss
from astrai_pl.objectives.teachers import ServerTeacher, TeacherError

K = 5


def local_top_k(model_dir, input_ids, labels):
    """The served model's own top-k ids and log-probabilities at each trained position (scored order)."""
    model = Transformer.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model(input_ids)
        logps = F.log_softmax(getattr(out, "logits", out).float(), -1)  # (B, T, V)
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], 1)
    top = logps[targets != IGNORE_INDEX].topk(K, -1)
    return top.indices, top.values


def sequences(tokenizer):
    prompts = chat_prompts(["What is 12 + 7?", "What is 3 - 5?"], tokenizer)
    completions = [tokenizer.encode("19"), tokenizer.encode("-2 it is")]
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = [p + c + [0] * (width - len(p) - len(c)) for p, c in zip(prompts, completions)]
    labels = [[IGNORE_INDEX] * len(p) + c + [IGNORE_INDEX] * (width - len(p) - len(c))
              for p, c in zip(prompts, completions)]
    return torch.tensor(ids), torch.tensor(labels)


def test_the_server_gives_each_positions_top_k_by_token_id(url, model_dir, tokenizer):
    input_ids, labels = sequences(tokenizer)
    ids, logps = ServerTeacher(url, MODEL, K).top_logprobs(input_ids, labels)
    local_ids, local_logps = local_top_k(model_dir, input_ids, labels)
    assert ids.shape == (int((labels != IGNORE_INDEX).sum()), K)
    order = ids.argsort(-1)
    local_order = local_ids.argsort(-1)
    assert torch.equal(ids.gather(-1, order), local_ids.gather(-1, local_order))
    torch.testing.assert_close(logps.gather(-1, order), local_logps.gather(-1, local_order), atol=1e-4, rtol=0)


def test_distill_on_a_served_teacher_is_the_divergence_over_its_top_k(url, model_dir, tokenizer):
    torch.manual_seed(0)
    student_arch = Transformer.from_pretrained(model_dir).config
    module = Distill(arch=student_arch, tokenizer=tokenizer, teacher_url=url, teacher_model_name=MODEL,
                     teacher_top_k=K, lmbda=0.0, beta=0.5)
    batch = {"prompt": [[{"role": "user", "content": "What is 12 + 7?"}]], "answer": ["19"],
             "prompt_ids": chat_prompts(["What is 12 + 7?"], tokenizer)}
    loss, metrics = module._shared_step(batch, "train")
    part = module.sequences(batch, "data")
    targets = torch.cat([part["labels"][:, 1:], torch.full_like(part["labels"][:, :1], IGNORE_INDEX)], 1)
    ids, logps = local_top_k(model_dir, part["input_ids"], part["labels"])
    with torch.no_grad():
        out = module.model(part["input_ids"])
        student = getattr(out, "logits", out)[targets != IGNORE_INDEX]
    expected, _ = topk_generalized_jsd_loss(student, ids, logps, beta=0.5)
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-4)
    assert loss.item() > 0 and metrics["tokens"].item() == len(student)


def test_an_unreachable_teacher_server_is_named_in_the_error(tokenizer):
    input_ids, labels = sequences(tokenizer)
    teacher = ServerTeacher("http://127.0.0.1:9", MODEL, K, timeout=2.0)  # the discard port: nothing listens
    with pytest.raises(TeacherError, match="127.0.0.1:9"):
        teacher.top_logprobs(input_ids, labels)


class Answering:
    """An httpx.Client stand-in whose every POST answers `body` (a server that misbehaves)."""

    def __init__(self, body):
        self.body = body

    def post(self, url, json):
        import httpx

        return httpx.Response(200, json=self.body, request=httpx.Request("POST", url))


@pytest.mark.parametrize("top", [{"token_id:5": float("nan")}, {"token_id:5": 0.5}, {"x": -1.0}, {"token_id:-3": -1.0}])
def test_a_server_answering_bad_log_probabilities_is_refused(tokenizer, top):
    input_ids, labels = sequences(tokenizer)
    body = {"choices": [{"logprobs": {"top_logprobs": [None] + [top] * input_ids.shape[1]}}]}
    teacher = ServerTeacher("http://teacher", MODEL, K, client=Answering(body))
    with pytest.raises(TeacherError, match="http://teacher"):
        teacher.top_logprobs(input_ids, labels)
