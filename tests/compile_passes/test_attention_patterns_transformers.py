"""Attention rewrites in whole models: tiny transformers models (eager and sdpa attention, Bloom's
ALiBi), and scores scaled by a tensor the model reads at run time."""
import pytest
import torch

import torch_flash
from torch_flash.compile_passes import Report
from _attention_cases import _calls, _compile
from _utils import assert_rel_close
from models import check_training


def _hf(name, impl):
    import transformers as T

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    make = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**common, num_key_value_heads=2)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**common, num_key_value_heads=2, sliding_window=3)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**common, num_key_value_heads=2)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**common, num_key_value_heads=1, head_dim=8)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4)),
        "gpt2_reordered": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                 reorder_and_upcast_attn=True)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**common)),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                    num_attention_heads=4, word_embed_proj_dim=32)),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**common)),
        "bert": lambda: T.BertModel(T.BertConfig(**common)),
        "roberta": lambda: T.RobertaModel(T.RobertaConfig(**common)),
        "vit": lambda: T.ViTModel(T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                              intermediate_size=64, image_size=16, patch_size=4)),
        "t5": lambda: T.T5Model(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
    }
    model = make[name]().eval()
    model.set_attn_implementation(impl)
    return model


# (name, causal self-attention expected, window_left expected)
HF = [("llama", True, -1), ("mistral", True, 2), ("qwen2", True, -1), ("gemma", True, -1), ("gpt2", True, -1),
      ("gpt2_reordered", True, -1), ("gpt_neox", True, -1), ("opt", True, -1), ("phi", True, -1),
      ("bert", False, -1), ("roberta", False, -1), ("vit", False, -1), ("t5", None, -1)]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name, causal, window_left", HF, ids=[h[0] for h in HF])
def test_transformers(name, causal, window_left, impl):
    """Every attention site of a tiny HF model is rewritten; decoders get causal=True (with the
    padding of attention_mask as attn_bias) where the mask hides with False; outputs at
    non-padded positions and parameter gradients match eager."""
    model = _hf(name, impl)
    ids = torch.randint(1, 64, (2, 7))
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, -2:] = 0  # right padding: every query sees a key
    if name == "vit":
        inputs = dict(pixel_values=torch.randn(2, 3, 16, 16))
    elif name == "t5":
        inputs = dict(input_ids=ids, attention_mask=attention_mask, decoder_input_ids=ids[:, :5])
    else:
        inputs = dict(input_ids=ids, attention_mask=attention_mask)
    report = Report()
    compiled, graphs = _compile(model, report)
    valid = attention_mask.bool() if "input_ids" in inputs and name != "t5" else ...

    weight = []

    def step(fn):
        model.zero_grad()
        out = fn(**inputs)
        out = (out.logits if hasattr(out, "logits") else out.last_hidden_state)[valid]
        weight.append(weight[0] if weight else torch.randn_like(out))  # (a post-LayerNorm output's
        (out * weight[0]).sum().backward()  # square has no gradient to speak of)
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (ref, ref_grads), (out, grads) = step(model), step(compiled)
    sites = [s for s in report.sites if s.family == "attention"]
    assert sites and all(s.rewritten for s in sites), str(report)
    assert_rel_close(out, ref, tol=1e-5)
    assert grads.keys() == ref_grads.keys()
    scale = max(g.norm() for g in ref_grads.values())
    for n, g in ref_grads.items():  # relative to the largest: key biases get none at all
        assert (grads[n] - g).norm() <= 1e-4 * g.norm() + 1e-6 * scale, n
    calls = _calls(graphs)
    assert len(calls) == len(sites)
    if name == "t5":  # encoder self, decoder self (causal), decoder cross, per layer
        assert [c["causal"] for c in calls] == [False, False, True, False, True, False]
    elif impl == "eager" and "input_ids" in inputs:
        # HF hides with finfo.min: a padded query row may see no key, and averages v (left padding),
        # so the mask goes in whole (test_attention_patterns_masks.py::test_finite_fill_hidden_rows_match_the_model)
        assert all(not c["causal"] and c["window_left"] == -1 and c["bias"] for c in calls), calls
    else:
        assert all(c["causal"] == causal and c["window_left"] == window_left for c in calls), calls


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_gpt_oss_sinks(padding):
    """gpt-oss's eager attention joins a sink column per head to the scores, subtracts the row
    max and slices the column off the softmax: it becomes flash.attention's sinks, with the
    model's loss and every gradient (the sinks' included), padded or not; the router's softmax
    is left with its reason."""
    import transformers as T
    torch.manual_seed(0)
    cfg = T.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                         num_experts_per_tok=2, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0), initializer_range=0.2)
    model = T.GptOssForCausalLM(cfg).train()
    model.set_attn_implementation("eager")
    ids = torch.randint(1, 64, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    if padding == "right":
        mask[1, -2:] = 0
    elif padding == "left":
        mask[1, :2] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    report = Report()
    compiled, graphs = _compile(model, report)

    def step(fn):
        model.zero_grad()
        loss = fn(**inputs).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (ref, ref_grads), (loss, grads) = step(model), step(compiled)
    sites = [s for s in report.sites if s.family == "attention"]
    assert sum(s.rewritten for s in sites) == 2 and all("2-D" in s.reason for s in sites if not s.rewritten), \
        str(report)
    assert_rel_close(loss, ref, tol=1e-5)
    assert grads.keys() == ref_grads.keys() and any("sinks" in n for n in grads)
    scale = max(g.norm() for g in ref_grads.values())
    for n, g in ref_grads.items():
        assert (grads[n] - g).norm() <= 1e-4 * g.norm() + 1e-6 * scale, n
    calls = _calls(graphs)
    assert len(calls) == 2 and all(c["sinks"] for c in calls), calls


class RuntimeScale(torch.nn.Module):
    """Scores scaled by a one-value tensor the model reads at run time, as PyTorch Inductor's
    _sfdp patterns spell it: divided by an inverse scale or multiplied by a scale factor,
    before an additive mask or without one; the factor a learned parameter (its gradient
    reaches it through q * c) or a buffer."""

    def __init__(self, how: str, mask: bool, learned: bool, d: int = 16):
        super().__init__()
        self.how, self.mask = how, mask
        self.proj = torch.nn.Linear(d, 3 * d)
        c = torch.tensor(d ** 0.5 if how == "div" else d ** -0.5)
        if learned:
            self.c = torch.nn.Parameter(c)
        else:
            self.register_buffer("c", c)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, -1).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
        scores = q @ k.transpose(-2, -1)
        scores = scores.div(self.c) if self.how == "div" else scores * self.c
        if self.mask:
            scores = scores + torch.full((s, s), float("-inf")).triu(1)
        return scores.softmax(-1) @ v


@pytest.mark.parametrize("how", ["div", "mul"])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("learned", [False, True])
def test_runtime_scale_tensor(how, mask, learned):
    """The scale folds into q (q * c, then scale 1.0): the same outputs and gradients, the
    factor's included, and the site reported rewritten."""
    torch.manual_seed(0)
    model, x = RuntimeScale(how, mask, learned), torch.randn(2, 6, 16)
    report = torch_flash.explain(model, x)
    assert [s.op for s in report.sites] == ["attention"], str(report)
    check_training(model, x)


def test_runtime_scale_after_a_mask_is_left_with_a_reason():
    """A mask added before the runtime scale would be scaled with the scores: left alone, with
    the reason in explain."""
    class ScaledAfterMask(RuntimeScale):
        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, 2, -1).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
            scores = (q @ k.transpose(-2, -1) + torch.randn(s, s)) * self.c
            return scores.softmax(-1) @ v

    report = torch_flash.explain(ScaledAfterMask("mul", False, False), torch.randn(2, 6, 16))
    assert [s.op for s in report.sites] == [None]
    assert "a mask or bias is added before a scale read from a tensor" in str(report)


def test_transformers_bloom():
    """HF Bloom (eager only): ALiBi through baddbmm on (B*H, S, D) tensors, the scores viewed
    as (B, H, S, S), finfo.min mask, fp32 softmax. Every site is rewritten with ALiBi in
    attn_bias (the mask whole: it hides with finfo.min) and the outputs equal the model's.
    Forward only here: the loss and every gradient (through Bloom's GeLU, a custom
    autograd.Function) are test_backend.py::test_bloom_gradients' and test_hf_models.py's."""
    import transformers as T

    model = T.BloomForCausalLM(T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)).eval()
    ids = torch.randint(1, 64, (2, 7))
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[0, :2] = 0  # left padding: rows that see no key
    report = Report()
    compiled, graphs = _compile(model, report)
    with torch.no_grad():
        out = compiled(input_ids=ids, attention_mask=attention_mask).logits
        ref = model(input_ids=ids, attention_mask=attention_mask).logits
    sites = [s for s in report.sites if s.family == "attention"]
    assert len(sites) == 2 and all(s.rewritten for s in sites), str(report)
    assert all(not c["causal"] and c["bias"] for c in _calls(graphs))
    assert_rel_close(out, ref, tol=1e-5)
