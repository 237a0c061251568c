"""Hugging Face transformers models (tiny configs, random weights, no downloads) through the
flash backend, with attn_implementation "eager" and "sdpa": every attention, norm, loss and
rotary site is rewritten (the sites counted from each config), the loss and every
parameter gradient equal eager's (fp32), and the backward graph runs the fused ops' own
backward. Each (model, impl) compiles once; the tests share that run."""
from __future__ import annotations

import copy
import functools
import inspect
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_flash  # noqa: E402
from torch_flash._registry import BY_NAME  # noqa: E402
from torch_flash.compile_passes import Report  # noqa: E402

from _utils import assert_rel_close, rel_err  # noqa: E402

# the backend falls back to the unrewritten graph with a warning: here that is a failure
pytestmark = pytest.mark.filterwarnings("error:torch_flash")

B, S, VOCAB, LABELS = 2, 8, 128, 10
FAMILIES = ("attention", "norm", "loss", "rotary")
# dropout 0 and no KV cache (a cache is an output that ends the graph before the loss);
# weights larger than the default 0.02 so attention is far from uniform. One layer: within it
# a norm already reads a residual sum that the next residual add reads too, as a later layer's
# first norm does, so a second layer adds no spelling, only tracing time. Two where it does:
# parallel blocks (GPT-NeoX, Phi: the sum that reaches a layer's two norms), T5 (the first
# layer's position bias reused) and Llama 4 (its per-layer choices)
COMMON = dict(num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64, use_cache=False,
              initializer_range=0.2)
DECODER = dict(COMMON, vocab_size=VOCAB, hidden_size=32, intermediate_size=64)
ENCODER = dict(COMMON, hidden_size=32, intermediate_size=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)


@dataclass
class Spec:
    config: str  # class names in transformers
    options: dict
    model: str
    task: str  # causal | masked | image | seq2seq: which inputs and labels
    ops: Callable  # config -> {flash op: sites}, counted from the architecture


def _llama_like(c):
    """Pre-norm RMSNorm decoders: the first norm reads the embeddings, every later one (and
    the final norm) a residual sum; rotary on q and k of each layer."""
    n = c.num_hidden_layers
    return {"attention": n, "rms_norm": 1, "add_rms_norm": 2 * n, "linear_cross_entropy": 1, "rotary": 2 * n}


def _llama4(c):
    """As LLaMA, with the rotary in complex numbers on every layer here, and on those layers
    q and k L2-normalised (RMSNorm without a weight) after it."""
    n = c.num_hidden_layers
    return {"attention": n, "rms_norm": 1 + 2 * n, "add_rms_norm": 2 * n, "linear_cross_entropy": 1, "rotary": 2 * n}


def _layer_norms(c, first_fused: bool, extra_layer_norms: int = 0):
    """Two LayerNorms a layer plus one more: the final norm of pre-norm stacks (GPT-2, OPT,
    ViT), the embeddings' norm of post-norm ones (BERT, RoBERTa). The norm that reads token +
    position embeddings fuses the add only when the positions have the batch dim too (not
    when (1, S, D) broadcasts)."""
    n = c.num_hidden_layers
    ops = {"attention": n, "add_layer_norm": 2 * n + first_fused, "linear_cross_entropy": 1}
    ops["layer_norm"] = (not first_fused) + extra_layer_norms
    return ops


def _parallel(c, norms_per_layer: int):
    """Parallel attention and MLP (GPT-NeoX: one norm each, Phi: one shared), partial rotary:
    the norms of a layer read one residual sum, which only the first of them can fuse."""
    n = c.num_hidden_layers
    return {"attention": n, "layer_norm": 1 + n * (norms_per_layer - 1), "add_layer_norm": n,
            "linear_cross_entropy": 1, "rotary": 2 * n}


def _bloom(c):
    """LayerNorm on the embeddings, then one that reads it (neither fuses an add), then the
    post-attention norm of each layer, the input norm of every later layer and the final norm
    read residual sums."""
    n = c.num_hidden_layers
    return {"attention": n, "layer_norm": 2, "add_layer_norm": 2 * n, "linear_cross_entropy": 1}


def _t5(c):
    """Encoder: 2 norms a layer, decoder: 3 (self, cross, MLP), each stack a final norm; the
    first of each stack reads embeddings, the rest residual sums. Attention: self per layer,
    cross per decoder layer."""
    enc, dec = c.num_layers, c.num_decoder_layers
    return {"attention": enc + 2 * dec, "rms_norm": 2, "add_rms_norm": 2 * enc + 3 * dec,
            "linear_cross_entropy": 1}


MODELS = {
    "llama": Spec("LlamaConfig", dict(DECODER, num_key_value_heads=2), "LlamaForCausalLM", "causal", _llama_like),
    "mistral": Spec("MistralConfig", dict(DECODER, num_key_value_heads=2), "MistralForCausalLM", "causal",
                    _llama_like),
    "qwen2": Spec("Qwen2Config", dict(DECODER, num_key_value_heads=2), "Qwen2ForCausalLM", "causal", _llama_like),
    "gemma": Spec("GemmaConfig", dict(DECODER, num_key_value_heads=2, head_dim=8), "GemmaForCausalLM", "causal",
                  _llama_like),
    # complex rotary (view_as_complex), MoE MLPs of 2 experts
    "llama4": Spec("Llama4TextConfig", dict(DECODER, num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
                                            intermediate_size_mlp=64, num_local_experts=2),
                   "Llama4ForCausalLM", "causal", _llama4),
    # positions (1, S, D) against tokens (B, S, D): the first norm stays unfused
    "gpt2": Spec("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, initializer_range=0.2),
                 "GPT2LMHeadModel", "causal", lambda c: _layer_norms(c, first_fused=False)),
    "gpt_neox": Spec("GPTNeoXConfig", dict(DECODER, num_hidden_layers=2, rotary_pct=0.5, hidden_dropout=0.0,
                                           attention_dropout=0.0),
                     "GPTNeoXForCausalLM", "causal", lambda c: _parallel(c, norms_per_layer=2)),
    # OPT flattens the tokens around the MLP: its residual sums reach the norms through views
    "opt": Spec("OPTConfig", dict(COMMON, vocab_size=VOCAB, hidden_size=32, ffn_dim=64, word_embed_proj_dim=32,
                                  dropout=0.0, attention_dropout=0.0),
                "OPTForCausalLM", "causal", lambda c: _layer_norms(c, first_fused=True)),
    "phi": Spec("PhiConfig", dict(DECODER, num_hidden_layers=2, partial_rotary_factor=0.5, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attention_dropout=0.0),
                "PhiForCausalLM", "causal", lambda c: _parallel(c, norms_per_layer=1)),
    # post-norm encoders, plus the MLM head's norm; BERT's positions are (1, S, D), RoBERTa's
    # (B, S, D)
    "bert": Spec("BertConfig", dict(ENCODER, vocab_size=VOCAB), "BertForMaskedLM", "masked",
                 lambda c: _layer_norms(c, first_fused=False, extra_layer_norms=1)),
    "roberta": Spec("RobertaConfig", dict(ENCODER, vocab_size=VOCAB), "RobertaForMaskedLM", "masked",
                    lambda c: _layer_norms(c, first_fused=True, extra_layer_norms=1)),
    # patches + (1, S, D) positions: the first norm stays unfused
    "vit": Spec("ViTConfig", dict(ENCODER, image_size=16, patch_size=8, num_labels=LABELS),
                "ViTForImageClassification", "image", lambda c: _layer_norms(c, first_fused=False)),
    # its GeLU is a custom autograd.Function (GeLUFunction): the gradients of the MLP below it
    # come only through that Function's backward; ALiBi through baddbmm
    "bloom": Spec("BloomConfig", dict(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4, hidden_dropout=0.0,
                                      attention_dropout=0.0, use_cache=False, initializer_range=0.2),
                  "BloomForCausalLM", "causal", _bloom),
    "t5": Spec("T5Config", dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
                                decoder_start_token_id=0, pad_token_id=0),
               "T5ForConditionalGeneration", "seq2seq", _t5),
}
# Under pytest-xdist (--dist loadgroup) a model's tests run in one worker, which compiles each of
# its runs (_run) once
CASES = [pytest.param(name, impl, id=f"{name}-{impl}", marks=pytest.mark.xdist_group(f"hf_{name}"))
         for name in MODELS for impl in ("eager", "sdpa")]

def _batch(task: str, left_padded: bool = False) -> dict:
    if task == "image":
        return {"pixel_values": torch.randn(B, 3, 16, 16), "labels": torch.randint(0, LABELS, (B,))}
    ids = torch.randint(1, VOCAB, (B, S))
    labels = torch.randint(1, VOCAB, (B, S)) if task == "seq2seq" else ids.clone()
    if left_padded:  # a batch for generation: the padding query rows see no key at all
        attention_mask = torch.ones(B, S, dtype=torch.long)
        attention_mask[0, :3] = 0
        labels[0, :3] = -100
        return {"input_ids": ids, "attention_mask": attention_mask, "labels": labels}
    labels[0, -3:] = -100  # padding, as HF marks it
    if task == "masked":
        labels[:, ::2] = -100  # only the masked positions carry a label
    return {"input_ids": ids, "labels": labels}


@dataclass
class Run:
    config: object
    report: Report
    loss: torch.Tensor
    ref_loss: torch.Tensor
    grads: dict
    ref_grads: dict
    forward_ops: set  # flash op names in the AOT forward graph
    backward_ops: set
    exact: tuple | None = None  # (loss, grads) of the model in float64, for autocast runs


def _flash_ops(gm) -> set:
    return {n.target.name().split("::")[1].split(".")[0] for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "flash"}


@functools.cache
def _draws_for_layerdrop(model: str) -> bool:
    """Whether this transformers' model draws a random number per layer in training and
    branches on it even with LayerDrop off (OPT in 5.17; 5.23 checks layerdrop > 0 first): a
    data-dependent branch, so a graph break under every torch.compile backend, whatever the
    pass does."""
    source = inspect.getsource(inspect.getmodule(getattr(transformers, model)))
    return re.search(r"if self\.training:\s+dropout_probability = torch\.rand", source) is not None


@functools.cache
def _run(name: str, impl: str, autocast: bool = False, left_padded: bool = False) -> Run:
    """One forward/backward of the model eagerly and through the flash backend. The backend
    hands the rewritten graph to AOTAutograd without Inductor (the graphs are what this
    tests, and Inductor would cost minutes here); the ops stay whole in those graphs.
    autocast: both forwards under CPU bf16 autocast, and the float64 model's run as well.
    left_padded: an attention_mask that pads the first tokens of one sequence."""
    spec = MODELS[name]
    if _draws_for_layerdrop(spec.model):
        pytest.xfail(f"{spec.model} in transformers {transformers.__version__} branches on torch.rand "
                     "for LayerDrop in training: a graph break under any backend")
    cls = getattr(transformers, spec.model)
    if impl == "sdpa" and not cls._supports_sdpa:
        pytest.skip(f"{spec.model} in transformers {transformers.__version__} does not support sdpa")
    torch.manual_seed(0)
    model = cls(getattr(transformers, spec.config)(**spec.options, attn_implementation=impl))
    assert model.config._attn_implementation == impl
    # GPT2LMHeadModel's name gives no loss type: HF warns (a graph break) and uses this one
    model.loss_type = model.loss_type or "ForCausalLM"
    batch = _batch(spec.task, left_padded)

    def step(fn, model=model):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(**batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    graphs = []

    def aot(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    report = Report()
    loss_of = lambda **kw: model(**kw).loss  # noqa: E731  (the logits die in the graph)
    ref_loss, ref_grads = step(loss_of)
    # every model compiles this one lambda's code: without a reset its cache entries pile up
    # to dynamo's recompile limit (8) and the ninth model runs eagerly, with no graphs. The
    # conftest's per-test reset is not enough: the H100 machine's pytest skipped that fixture
    # here when the command line named test files of other folders in between
    torch._dynamo.reset()
    compiled = torch.compile(loss_of, backend=torch_flash.backend(inner=aot, report=report))
    with torch._functorch.config.patch(decompose_custom_triton_ops=False):
        loss, grads = step(compiled)
    assert len(graphs) == 2, f"{len(graphs)} AOT graphs: expected one forward and one backward (no graph breaks)"
    exact = None
    if autocast:
        exact_model = copy.deepcopy(model).double()
        exact = step(lambda **kw: exact_model(**kw).loss, exact_model)
    return Run(model.config, report, loss, ref_loss, grads, ref_grads, _flash_ops(graphs[0]), _flash_ops(graphs[1]),
               exact)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name, impl", CASES)
def test_sites(name, impl, family):
    """Every site of the family is found and rewritten, as many as the architecture has, to
    the expected ops (add_* where a residual sum feeds the norm)."""
    run = _run(name, impl)
    expected = {op: k for op, k in MODELS[name].ops(run.config).items() if k and BY_NAME[op].family == family}
    sites = [s for s in run.report.sites if s.family == family]
    assert not [s for s in sites if not s.rewritten], str(run.report)
    assert Counter(s.op for s in sites) == expected, str(run.report)
    if family == "attention":  # the spelling of the implementation was the one matched
        want = "F.scaled_dot_product_attention" if impl == "sdpa" else "softmax"
        assert {s.anchor for s in sites} == {want}


def _assert_same_training(run: Run, grad_tol: float | None = None) -> None:
    assert_rel_close(run.loss, run.ref_loss, what="loss")
    assert run.grads.keys() == run.ref_grads.keys()
    scale = max(g.norm() for g in run.ref_grads.values())
    for param, ref in run.ref_grads.items():
        if ref.norm() <= 1e-6 * scale:
            # the key bias: softmax is blind to a shift shared by a query's scores, so its true
            # gradient is 0 and both runs hold rounding noise, which relative error cannot judge
            assert run.grads[param].norm() <= 1e-6 * scale, param
        else:
            assert_rel_close(run.grads[param], ref, tol=grad_tol, what=param)


@pytest.mark.parametrize("name, impl", CASES)
def test_loss_and_gradients(name, impl):
    """The loss and every parameter gradient of the compiled run equal eager's (fp32)."""
    _assert_same_training(_run(name, impl))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_left_padded_batch(impl):
    """Left padding: in eager mode HF hides every key of the padding query rows with finfo.min,
    so the model averages v there (and the last padding row predicts the first real token,
    so those rows reach the loss). Every site is still rewritten, and the loss and gradients
    equal the model's. Gradients to 5e-4 in eager mode: on those rows the op's fp32
    log-sum-exp sits at its fill score -1e4, whose rounding (at most 4.9e-4, half an fp32 step
    at 1e4) scales the rows' weights; before this the rows gave 0 and gradients were off by
    0.2-0.5."""
    run = _run("llama", impl, left_padded=True)
    expected = {op: k for op, k in MODELS["llama"].ops(run.config).items() if k}
    assert Counter(s.op for s in run.report.sites) == expected, str(run.report)
    _assert_same_training(run, grad_tol=5e-4 if impl == "eager" else None)


@pytest.mark.parametrize("name, impl", CASES)
def test_fused_backward(name, impl):
    """The rewritten ops run in the forward graph and their own backward ops in the backward
    graph; a loss op may instead compute its gradients in the forward (`<op>_with_grads`:
    linear_cross_entropy, whose backward then only scales them); rotary sites of q and k run
    as one flash.rotary_qk."""
    run = _run(name, impl)
    rewritten = {s.op for s in run.report.sites if s.rewritten}
    assert rewritten
    for op in rewritten:
        launched = [f for f in (op, op + "_qk") if f in run.forward_ops] if op == "rotary" else [op]
        with_grads = [f for f in run.forward_ops if f.startswith(op + "_with_")]
        assert any(f in run.forward_ops for f in launched) or with_grads, (op, run.forward_ops)
        in_forward = BY_NAME[op].family == "loss" and op + "_with_grads" in run.forward_ops
        assert in_forward or any(BY_NAME[f].backward in run.backward_ops for f in launched), (op, run.backward_ops)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma", "gpt_neox", "llama4"])
def test_autocast(name, impl):
    """bf16 autocast over the fp32 model, as mixed-precision training runs it: q and k leave the
    rotary in fp32 (HF casts cos/sin to the fp32 hidden states' dtype), v is bf16, and attention
    runs in bf16. Every site is still rewritten (the rotary writes bf16 for the attention that
    reads it), and the loss and gradients are as close to the float64 model's as eager
    autocast's are (within 2x, or 1e-2)."""
    run = _run(name, impl, autocast=True)
    expected = {op: k for op, k in MODELS[name].ops(run.config).items() if k}
    assert not [s for s in run.report.sites if not s.rewritten], str(run.report)
    assert Counter(s.op for s in run.report.sites) == expected, str(run.report)
    exact_loss, exact_grads = run.exact
    assert rel_err(run.loss, exact_loss) <= max(2 * rel_err(run.ref_loss, exact_loss), 1e-2)
    for param, exact in exact_grads.items():
        allowed = max(2 * rel_err(run.ref_grads[param], exact), 1e-2)
        assert rel_err(run.grads[param], exact) <= allowed, param
