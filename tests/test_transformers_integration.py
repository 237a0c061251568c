"""attn_implementation="torch_flash" in Hugging Face transformers models (tiny configs, random
weights, no downloads): outputs, loss and gradients against attn_implementation="eager" by
relative error, fp32 on the CPU path."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch_flash import _dispatch  # noqa: E402
from torch_flash.integrations import transformers as tf_flash  # noqa: E402

from _utils import assert_rel_close, rel_err  # noqa: E402

TOL = 1e-5
VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
             initializer_range=0.2)  # large enough that scores are far from uniform
# decoder families and what each adds: GQA (all), sliding window on every layer (Mistral),
# mixed sliding/full layers (Qwen2), softcap + non-default scale + sliding layers (Gemma2),
# attention sinks (s_aux) + mixed layers + mixture of experts (gpt-oss)
DECODERS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=4),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4,
                                              layer_types=["sliding_attention", "full_attention"]),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, sliding_window=4, attn_logit_softcapping=2.0,
                                                query_pre_attn_scalar=9, final_logit_softcapping=None),
    "gpt_oss": lambda: transformers.GptOssConfig(**SMALL, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                                                 layer_types=["sliding_attention", "full_attention"],
                                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    tf_flash.register()


def _decoder(family: str, **config) -> torch.nn.Module:
    cfg = DECODERS[family]()
    for k, v in config.items():
        setattr(cfg, k, v)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def _mask(padding: str, b: int = 3, s: int = 12) -> torch.Tensor | None:
    """(B, S) padding mask: row 0 padded, row 1 the other way (or not), row 2 full."""
    if padding == "none":
        return None
    mask = torch.ones(b, s, dtype=torch.long)
    if padding == "left":
        mask[0, :5] = 0
        mask[1, :1] = 0
    else:
        mask[0, -5:] = 0
        mask[1, -1:] = 0
    return mask


def _run(model, impl: str, mask, inputs: dict, loss_fn) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(output, loss, parameter grads) of one forward and backward with attn_implementation impl."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    _dispatch.LAST.clear()
    out = model(**inputs, attention_mask=mask)
    loss = loss_fn(out)
    loss.backward()
    if impl == tf_flash.NAME:  # the flash ops ran, forward and backward; padded batches go varlen
        ops = {"attention_varlen", "attention_varlen_backward"} if mask is not None else \
            {"attention_with_lse", "attention_backward"}
        assert ops <= _dispatch.LAST.keys(), dict(_dispatch.LAST)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, loss.detach(), grads


def _compare(model, mask, inputs: dict, loss_fn, select) -> None:
    ref, ref_loss, ref_grads = _run(model, "eager", mask, inputs, loss_fn)
    out, loss, grads = _run(model, tf_flash.NAME, mask, inputs, loss_fn)
    valid = torch.ones(select(ref).shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    assert_rel_close(select(out)[valid], select(ref)[valid], TOL, what="output")
    assert_rel_close(loss, ref_loss, TOL, what="loss")
    assert grads.keys() == ref_grads.keys()
    # some gradients are zero up to rounding (a key bias shifts every score of a row
    # alike): those are held to the same absolute error as the largest one
    floor = TOL * max(g.norm() for g in ref_grads.values())
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm()
        assert err <= max(TOL * g.norm(), floor), f"grad of {name}: error {err:.3e}, norm {g.norm():.3e}"


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("family", list(DECODERS))
def test_decoder_forward_loss_grads(family, padding):
    model = _decoder(family).train()  # attention dropout 0: deterministic
    mask = _mask(padding)
    ids = torch.randint(0, VOCAB, (3, 12))
    # the loss predicts token t from position t - 1: neither may be padding (a padded
    # position's output is undefined: zeros here, attention over nothing in eager)
    labels = ids if mask is None else ids.masked_fill((mask * mask.roll(1, 1)) == 0, -100)
    _compare(model, mask, dict(input_ids=ids, labels=labels), lambda o: o.loss, lambda o: o.logits)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_generate_with_kv_cache(family):
    """Greedy decoding of a left-padded batch past the sliding window (4): same tokens and
    logits at every step as eager."""
    model = _decoder(family).eval()
    ids = torch.randint(0, VOCAB, (3, 12))
    mask = _mask("left")
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    results = {}
    for impl in ("eager", tf_flash.NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            results[impl] = model.generate(ids, **kw)
    ref, out = results["eager"], results[tf_flash.NAME]
    assert torch.equal(out.sequences, ref.sequences)
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        assert_rel_close(a, b, TOL, what=f"logits of step {step}")


def test_packed_sequences_from_position_ids():
    """Padding-free batch: two sequences packed in one row, told apart by position_ids
    (transformers calls the varlen op); equal to running them one by one."""
    model = _decoder("llama").eval()
    ids = torch.randint(0, VOCAB, (1, 12))
    model.set_attn_implementation(tf_flash.NAME)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])).logits
        model.set_attn_implementation("eager")
        ref = torch.cat([model(input_ids=ids[:, :5]).logits, model(input_ids=ids[:, 5:]).logits], 1)
    assert_rel_close(out, ref, TOL)


def test_attention_dropout_in_training():
    """Dropout runs in training (reproducible under the seed, different without it) and is
    off in eval, where the results equal eager's."""
    model = _decoder("llama", attention_dropout=0.3).train()
    model.set_attn_implementation(tf_flash.NAME)
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = _mask("left", b=2)

    def loss_and_grad(seed):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    (l1, g1), (l2, g2), (l3, g3) = loss_and_grad(0), loss_and_grad(0), loss_and_grad(1)
    assert torch.isfinite(l1) and torch.isfinite(g1).all()
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert not torch.equal(l1, l3) and not torch.equal(g1, g3)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        ref = model(input_ids=ids, attention_mask=mask).logits
    assert_rel_close(out[mask.bool()], ref[mask.bool()], TOL)


def test_encoder_bert_padding():
    """Bidirectional attention (is_causal False) with a right-padded batch."""
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=96, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, max_position_embeddings=64,
                                  initializer_range=0.2)
    model = transformers.BertModel(cfg, add_pooling_layer=False).train()
    mask = _mask("right")
    ids = torch.randint(0, VOCAB, (3, 12))
    weight = torch.randn(64)
    _compare(model, mask, dict(input_ids=ids),
             lambda o: (o.last_hidden_state @ weight)[mask.bool()].square().mean(),
             lambda o: o.last_hidden_state)


def test_model_built_with_the_name():
    assert tf_flash.register() == tf_flash.NAME  # idempotent
    cfg = DECODERS["llama"]()
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=tf_flash.NAME)
    assert model.config._attn_implementation == tf_flash.NAME
    _dispatch.LAST.clear()
    model(input_ids=torch.randint(0, VOCAB, (1, 5)))
    assert "attention_with_lse" in _dispatch.LAST


def test_rejects_a_model_built_4d_mask():
    """A model that makes its own (B, 1, Sq, Sk) mask would have it ignored: clear error."""
    model = _decoder("llama")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 16)
    kv = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="torch_flash .transformers.: .* 4D attention mask"):
        tf_flash._attention_forward(attn, q, kv, kv, torch.zeros(1, 1, 5, 5))


# --- use_linear_cross_entropy: the causal-LM loss on flash.linear_cross_entropy ---------------

LCE_MODELS = {  # family -> (config, what it adds)
    "llama": lambda: transformers.LlamaConfig(**SMALL),  # untied lm-head
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, final_logit_softcapping=3.0),  # softcap
    "gemma3": lambda: transformers.Gemma3TextConfig(**SMALL, final_logit_softcapping=3.0),
    # MoE: the router's auxiliary loss is added to the fused loss by the model's own forward
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                  output_router_logits=True, router_aux_loss_coef=0.1),
}
# the loss's inputs, and "checkpointing": labels with transformers' gradient checkpointing on
LOSS_INPUTS = ["labels", "num_items_in_batch", "shift_labels", "checkpointing"]


def _float64_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                            shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss without its cast of the logits to float32."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                             ignore_index=ignore_index,
                                             reduction="mean" if num_items_in_batch is None else "sum")
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _lce_pair(family: str, dtype=torch.float64, device="cpu"):
    """(model with transformers' loss, the same weights patched), in training mode."""
    import copy
    model = transformers.AutoModelForCausalLM.from_config(  # experts: grouped_mm has no float64
        LCE_MODELS[family](), attn_implementation="eager", experts_implementation="eager")
    model = model.to(device, dtype).train()
    return model, tf_flash.use_linear_cross_entropy(copy.deepcopy(model))


def _lce_batch(kind: str, device="cpu") -> dict:
    ids = torch.randint(0, VOCAB, (3, 12), device=device)
    labels = ids.masked_fill(torch.rand(3, 12, device=device) < 0.25, -100)
    if kind == "shift_labels":  # shifted by the caller (context parallel); labels ask for the loss
        return dict(input_ids=ids, labels=ids, shift_labels=labels)
    batch = dict(input_ids=ids, labels=labels)
    if kind == "num_items_in_batch":  # the Trainer's count over all micro-batches of a step
        batch["num_items_in_batch"] = torch.tensor(50)
    return batch


def _loss_and_grads(model, batch: dict, call=None):
    """(output, loss, parameter grads) of one step through call (default: the model)."""
    model.zero_grad(set_to_none=True)
    out = (model if call is None else call)(**batch)
    out.loss.backward()
    return out, out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", LOSS_INPUTS)
@pytest.mark.parametrize("family", list(LCE_MODELS))
def test_lce_loss_and_grads(family, kind):
    """float64: loss and every parameter's gradient equal transformers' loss computed on the
    model's own logits in float64; the loss also equals transformers' own (which casts the
    logits to float32). The lm-head sees the hidden states but computes zero tokens."""
    ref_model, model = _lce_pair(family)
    if kind == "checkpointing":  # the decoder layers rerun in the backward
        for m in (ref_model, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert m.is_gradient_checkpointing
    batch = _lce_batch(kind)
    hf_loss = ref_model(**batch).loss.detach()
    ref_model.loss_function = _float64_causal_lm_loss
    _, ref_loss, ref_grads = _loss_and_grads(ref_model, batch)

    head_outputs = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, o: head_outputs.append(o.shape))
    _dispatch.LAST.clear()
    out, loss, grads = _loss_and_grads(model, batch)
    assert "linear_cross_entropy_with_grads" in _dispatch.LAST
    assert out.logits is None and head_outputs == [(3, 0, VOCAB)]
    assert_rel_close(loss, ref_loss, 1e-12, what="loss")
    assert_rel_close(loss, hf_loss.double(), 1e-6, what="loss vs transformers' float32 loss")
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert_rel_close(grads[name], g, 1e-10, what=f"grad of {name}")


def test_lce_outputs_outside_training():
    """Eval (with labels) and no labels: logits and loss as transformers computes them; a tuple
    output in training holds the loss and no logits placeholder."""
    ref_model, model = _lce_pair("llama")
    batch = _lce_batch("labels")
    model.eval(), ref_model.eval()
    with torch.no_grad():
        out, ref = model(**batch), ref_model(**batch)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
        assert torch.equal(model(input_ids=batch["input_ids"]).logits, ref.logits)
    model.train()
    tup = model(**batch, return_dict=False, use_cache=False)
    assert isinstance(tup, tuple) and tup[0].dim() == 0
    assert not any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in tup)
    assert tf_flash.use_linear_cross_entropy(model) is model  # idempotent


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_lce_autocast(family, device, monkeypatch):
    """bf16 autocast over float32 weights: the fused matmuls run in bf16 as the lm-head would,
    and loss and gradient errors against the float64 model are within 2x of transformers' own."""
    dtypes = []

    def recording(hidden, weight, *args, **kwargs):
        dtypes.append((hidden.dtype, weight.dtype))
        return tf_flash_lce(hidden, weight, *args, **kwargs)

    tf_flash_lce = tf_flash.linear_cross_entropy
    monkeypatch.setattr(tf_flash, "linear_cross_entropy", recording)
    ref64, _ = _lce_pair(family, device=device)
    ref64.loss_function = _float64_causal_lm_loss
    batch = _lce_batch("labels", device)
    _, ref_loss, ref_grads = _loss_and_grads(ref64, batch)
    errors = {}
    for fused in (False, True):
        model = _lce_pair(family, torch.float32, device)[0]
        model.load_state_dict(ref64.state_dict())
        if fused:
            model = tf_flash.use_linear_cross_entropy(model)
        _dispatch.LAST.clear()
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss, grads = _loss_and_grads(model, batch)
        if fused:  # the Triton kernels on the GPU
            assert _dispatch.LAST["linear_cross_entropy_with_grads"] == ("triton" if device == "cuda" else "reference")
        head = ref64.get_output_embeddings().weight
        name = next(n for n, p in ref64.named_parameters() if p is head)
        errors[fused] = (rel_err(loss.double(), ref_loss), rel_err(grads[name].double(), ref_grads[name]))
    assert dtypes == [(torch.bfloat16, torch.bfloat16)]
    # a scalar's error below bf16's resolution (2^-8) is the luck of its roundings: floor 1e-3
    assert errors[True][0] <= max(2 * errors[False][0], 1e-3), errors
    assert errors[True][1] <= 2 * errors[False][1], errors


def test_lce_under_torch_compile():
    """torch.compile(model) of the patched model: the fused op is in the graph, results as eager."""
    _, model = _lce_pair("llama")
    batch = _lce_batch("num_items_in_batch")
    _, ref_loss, ref_grads = _loss_and_grads(model, batch)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _dispatch.LAST.clear()
    out, loss, grads = _loss_and_grads(model, batch, compiled)
    assert "linear_cross_entropy_with_grads" in _dispatch.LAST
    assert out.logits is None
    assert_rel_close(loss, ref_loss, 1e-12, what="loss")
    for name, g in ref_grads.items():
        assert_rel_close(grads[name], g, 1e-10, what=f"grad of {name}")


def test_lce_refusals():
    """Logits scaled before the loss (Cohere), a custom loss function, a model that is not a
    causal LM: clear errors, never a loss computed on the wrong logits."""
    cohere = transformers.AutoModelForCausalLM.from_config(
        transformers.CohereConfig(**SMALL, logit_scale=0.5)).train()
    tf_flash.use_linear_cross_entropy(cohere)
    with pytest.raises(RuntimeError, match="CohereForCausalLM changes the logits between its lm-head"):
        cohere(**_lce_batch("labels"))
    cohere.eval()
    assert cohere(**_lce_batch("labels")).logits.shape == (3, 12, VOCAB)  # refused only when fused

    custom = transformers.AutoModelForCausalLM.from_config(LCE_MODELS["llama"]())
    custom.loss_function = _float64_causal_lm_loss
    with pytest.raises(ValueError, match="LlamaForCausalLM has its own loss function"):
        tf_flash.use_linear_cross_entropy(custom)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=VOCAB, hidden_size=64,
                                                                num_hidden_layers=1, num_attention_heads=4,
                                                                intermediate_size=96))
    with pytest.raises((TypeError, ValueError), match="BertForMaskedLM"):
        tf_flash.use_linear_cross_entropy(bert)
