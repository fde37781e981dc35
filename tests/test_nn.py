"""torch_tma.nn: the Linear replacement follows its weights through every way PyTorch moves them, the swap
functions, CUDA graphs that survive a weight reload, torch.compile, autograd.

One _test_*(device) helper per behaviour with thin CPU and CUDA wrappers; CUDA needs sm_90 (requires_sm90).
"""

import copy
import csv
import gc
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_tma
from torch_tma import decode_demo
from torch_tma.nn import Linear, refresh, swap_linear_, unswap_linear_

from test_ops import (CUDA_TIMEOUT_S, assert_matches_reference, poison_next_allocation, python_output,
                      reference)

IN, OUT = 256, 384


def new_linear(device, dtype=torch.float32, bias=True):
    """A fresh nn.Linear (random init) and its torch_tma replacement, sharing the Parameters."""
    linear = nn.Linear(IN, OUT, bias=bias, device=device, dtype=dtype)
    return linear, Linear.from_linear(linear)


def random_like_weights(m: nn.Linear):
    """Fresh weight and bias values in m's dtype and device, at nn.Linear's init scale."""
    bound = 1 / math.sqrt(m.in_features)
    new = lambda t: None if t is None else torch.empty_like(t).uniform_(-bound, bound).detach()
    return new(m.weight), new(m.bias)


def check_forward(m: Linear, weight, bias) -> None:
    """m(x) computes with exactly these weight and bias values; on CUDA its descriptor encodes the current weight."""
    x = torch.randn(3, m.in_features, device=weight.device, dtype=weight.dtype)
    poison_next_allocation((3, m.out_features), weight.dtype, weight.device)
    assert_matches_reference(m(x), *reference(x, weight, bias))
    if weight.is_cuda:
        decoded = torch_tma.decode(m.weight_map.map.raw)
        assert decoded.address == m.weight.data_ptr() and decoded.dims == tuple(reversed(m.weight.shape))


def cuda_test(fn):
    """The CUDA wrapper's marks: an sm_90 GPU and a hard timeout (a TMA or mbarrier mistake hangs)."""
    return pytest.mark.requires_sm90(pytest.mark.timeout(CUDA_TIMEOUT_S)(fn))


# ---- one layer and its weights --------------------------------------------------------------------------


def _test_from_linear_shares_parameters(device):
    linear, m = new_linear(device, torch.bfloat16 if device == "cuda" else torch.float32)
    assert m.weight is linear.weight and m.bias is linear.bias
    assert list(m.state_dict()) == list(linear.state_dict()) == ["weight", "bias"]
    assert "l2_promotion=kernel default" in repr(m)
    assert "l2_promotion=L2_256B" in repr(Linear.from_linear(linear, l2_promotion=torch_tma.L2Promotion.L2_256B))
    check_forward(m, linear.weight, linear.bias)
    if device == "cuda":
        assert f"weight_map=0x{m.weight_map.map.ptr:x}" in repr(m)


def test_from_linear_shares_parameters_cpu():
    _test_from_linear_shares_parameters("cpu")


@cuda_test
def test_from_linear_shares_parameters_cuda():
    _test_from_linear_shares_parameters("cuda")


def _test_deepcopy(device):
    _, m = new_linear(device, torch.bfloat16)
    check_forward(m, m.weight, m.bias)
    clone = copy.deepcopy(m)
    assert clone.weight.data_ptr() != m.weight.data_ptr()
    check_forward(clone, clone.weight, clone.bias)
    if device == "cuda":
        assert clone.weight_map.map.ptr != m.weight_map.map.ptr


def test_deepcopy_cpu():
    _test_deepcopy("cpu")


@cuda_test
def test_deepcopy_cuda():
    _test_deepcopy("cuda")


def _test_to(device):
    _, m = new_linear("cpu")
    check_forward(m, m.weight, m.bias)
    m.to(device, torch.bfloat16)
    check_forward(m, m.weight, m.bias)


def test_to_cpu():
    _test_to("cpu")


@cuda_test
def test_to_cuda():
    _test_to("cuda")


@cuda_test
def test_cuda_method():
    _, m = new_linear("cpu", torch.bfloat16)
    check_forward(m, m.weight, m.bias)
    assert m.weight_map is None
    m.cuda()
    check_forward(m, m.weight, m.bias)
    m.cpu()  # unbinds: the descriptor's slot goes back to the cache
    check_forward(m, m.weight, m.bias)
    assert m.weight_map is None


def _test_half_and_bfloat16(device):
    _, m = new_linear(device, torch.bfloat16)
    check_forward(m, m.weight, m.bias)
    for convert, dtype in ((m.half, torch.float16), (m.bfloat16, torch.bfloat16)):
        convert()
        assert m.weight.dtype == dtype
        check_forward(m, m.weight, m.bias)


def test_half_and_bfloat16_cpu():
    _test_half_and_bfloat16("cpu")


@cuda_test
def test_half_and_bfloat16_cuda():
    _test_half_and_bfloat16("cuda")


def _moves_weight_to_new_storage(device, move):
    """move(m, weight, bias) puts new values into m in new storage; the layer must follow, on CUDA in the same slot."""
    _, m = new_linear(device, torch.bfloat16)
    check_forward(m, m.weight, m.bias)
    slot = m.weight_map.map.ptr if device == "cuda" else None
    weight, bias = random_like_weights(m)
    old_address = m.weight.data_ptr()
    move(m, weight, bias)
    assert m.weight.data_ptr() != old_address
    check_forward(m, weight, bias)
    if device == "cuda":
        assert m.weight_map.map.ptr == slot


def _test_load_state_dict_assign(device):
    def move(m, weight, bias):
        m.load_state_dict({"weight": weight.clone(), "bias": bias.clone()}, assign=True)

    _moves_weight_to_new_storage(device, move)


def test_load_state_dict_assign_cpu():
    _test_load_state_dict_assign("cpu")


@cuda_test
def test_load_state_dict_assign_cuda():
    _test_load_state_dict_assign("cuda")


def _test_param_data_assign(device):
    def move(m, weight, bias):
        m.weight.data = weight.clone()
        m.bias.data = bias.clone()

    _moves_weight_to_new_storage(device, move)


def test_param_data_assign_cpu():
    _test_param_data_assign("cpu")


@cuda_test
def test_param_data_assign_cuda():
    _test_param_data_assign("cuda")


def _test_inplace_copy(device):
    _, m = new_linear(device, torch.bfloat16)
    check_forward(m, m.weight, m.bias)
    stats = torch_tma.default_cache(device).stats() if device == "cuda" else None
    weight, bias = random_like_weights(m)
    with torch.no_grad():
        m.weight.copy_(weight)
        m.bias.copy_(bias)
    check_forward(m, weight, bias)
    if device == "cuda":  # same storage: the descriptor is still right, nothing is encoded
        after = torch_tma.default_cache(device).stats()
        assert (after["encodes"], after["refreshes"]) == (stats["encodes"], stats["refreshes"])


def test_inplace_copy_cpu():
    _test_inplace_copy("cpu")


@cuda_test
def test_inplace_copy_cuda():
    _test_inplace_copy("cuda")


def _test_gradients_match_nn_linear(device, dtype):
    linear, m = new_linear(device, dtype)
    x = torch.randn(2, 5, IN, device=device, dtype=dtype)
    grad_out = torch.randn(2, 5, OUT, device=device, dtype=dtype)

    def grads(module, x):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(module(x), (x, module.weight, module.bias), grad_out.to(x))

    ours, stock, ref = grads(m, x), grads(linear, x), grads(_float64_copy(linear), x.double().cpu())
    for g_ours, g_stock, g_ref in zip(ours, stock, ref):
        assert_matches_reference(g_ours, g_stock, g_ref)


def _float64_copy(linear: nn.Linear) -> nn.Linear:
    copy = nn.Linear(linear.in_features, linear.out_features, dtype=torch.float64)
    copy.load_state_dict({k: v.double().cpu() for k, v in linear.state_dict().items()})
    return copy


def test_gradients_match_nn_linear_cpu():
    _test_gradients_match_nn_linear("cpu", torch.float64)
    m = Linear(24, 16, dtype=torch.float64)
    x = torch.randn(4, 24, dtype=torch.float64, requires_grad=True)
    call = lambda x, w, b: torch.func.functional_call(m, {"weight": w, "bias": b}, (x,))
    assert torch.autograd.gradcheck(call, (x, m.weight, m.bias))


@cuda_test
def test_gradients_match_nn_linear_cuda():
    _test_gradients_match_nn_linear("cuda", torch.bfloat16)


def test_torch_func_transforms_of_a_swapped_layer_match_nn_linear():
    """torch.func.grad / jacrev / vmap over functional_call: the transform's weight is a wrapper without storage,
    which the layer must not try to bind (it read its data_ptr)."""
    stock = nn.Linear(5, 4, dtype=torch.float64)
    ours = Linear.from_linear(copy.deepcopy(stock))
    params = {k: v.detach() for k, v in stock.named_parameters()}
    x = torch.randn(3, 5, dtype=torch.float64)
    loss = lambda m: (lambda p, x: torch.func.functional_call(m, p, (x,)).pow(2).sum())  # noqa: E731
    for transform in (lambda f: torch.func.grad(f), lambda f: torch.func.jacrev(f),
                      lambda f: torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))):
        got, want = transform(loss(ours))(params, x), transform(loss(stock))(params, x)
        assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k]) for k in want)


# ---- swapping -------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 128)
        self.narrow = nn.Linear(12, 64)  # 24-byte rows in 16 bits: TMA cannot serve it
        self.attn = nn.MultiheadAttention(64, 4)  # out_proj is a subclass of nn.Linear

    def forward(self, x):
        return self.attn(self.proj(x)[..., :64], x, x, need_weights=False)[0] + self.narrow(x[..., :12])


def _model():
    shared = nn.Linear(64, 64)
    return nn.Sequential(Block(), shared, nn.ReLU(), shared)


def test_swap_linear_replaces_in_place_and_reports_the_rest():
    model = _model()
    params = dict(model.named_parameters())
    x = torch.randn(3, 64)
    before = model(x)
    report = []
    assert swap_linear_(model, report=report) is model
    assert isinstance(model[0].proj, Linear) and isinstance(model[1], Linear) and model[1] is model[3]
    assert type(model[0].narrow) is nn.Linear and not isinstance(model[0].attn.out_proj, Linear)
    reasons = dict(report)
    assert sorted(reasons) == ["0.attn.out_proj", "0.narrow"]
    assert "in_features=12" in reasons["0.narrow"] and "subclasses nn.Linear" in reasons["0.attn.out_proj"]
    assert all(p is params[name] for name, p in model.named_parameters())
    assert torch.equal(model(x), before)

    assert unswap_linear_(model) is model
    assert not any(isinstance(m, Linear) for m in model.modules()) and model[1] is model[3]
    assert all(p is params[name] for name, p in model.named_parameters())
    assert torch.equal(model(x), before)


def test_swap_linear_filter_receives_module_and_fqn():
    model = _model()
    seen, report = [], []

    def keep_proj_out(module, fqn):
        seen.append((type(module), fqn))
        return fqn != "0.proj"

    swap_linear_(model, keep_proj_out, report=report)
    assert sorted(fqn for _, fqn in seen) == ["0.narrow", "0.proj", "1"]  # the shared layer is offered once
    assert all(cls is nn.Linear for cls, _ in seen)
    assert type(model[0].proj) is nn.Linear and isinstance(model[0].narrow, Linear)
    assert ("0.proj", "filter_fn returned False") in report


def test_swap_linear_of_a_root_linear_returns_the_new_root():
    linear = nn.Linear(32, 16)
    swapped = swap_linear_(linear, l2_promotion=torch_tma.L2Promotion.NONE)
    assert isinstance(swapped, Linear) and swapped.weight is linear.weight
    assert swapped.l2_promotion == int(torch_tma.L2Promotion.NONE)
    back = unswap_linear_(swapped)
    assert type(back) is nn.Linear and back.weight is linear.weight and back.bias is linear.bias


def test_swap_and_unswap_keep_hooks_buffers_and_attributes():
    calls = []
    linear = nn.Linear(32, 16)
    linear.register_forward_pre_hook(lambda module, args: calls.append(("pre", type(module).__name__)))
    linear.register_forward_hook(lambda module, args, out: calls.append(("post", type(module).__name__)))
    linear.register_buffer("scale", torch.rand(16))
    linear.tag = "kept"
    model = nn.Sequential(linear)
    for step, cls in ((swap_linear_, Linear), (unswap_linear_, nn.Linear)):
        calls.clear()
        model = step(model)
        layer = model[0]
        assert type(layer) is cls and layer.weight is linear.weight and layer.tag == "kept"
        assert list(model.state_dict()) == ["0.weight", "0.bias", "0.scale"]
        assert torch.equal(layer.scale, linear.scale)
        model(torch.randn(2, 32))
        assert calls == [("pre", cls.__name__), ("post", cls.__name__)]
    layer.register_buffer("late", torch.zeros(1))  # the modules' dicts are copies: nothing leaks back
    assert "late" not in linear._buffers


def test_hook_handles_from_before_a_swap_still_remove_their_hooks():
    calls = []
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8))
    pre = model[0].register_forward_pre_hook(lambda module, args: calls.append("pre"))
    post = model[1].register_forward_hook(lambda module, args, kwargs, out: calls.append("post"), with_kwargs=True)
    swap_linear_(model)
    assert [type(m) for m in model] == [Linear, Linear]
    model(torch.randn(2, 32))
    assert calls == ["pre", "post"]
    pre.remove()
    unswap_linear_(model)
    post.remove()  # registered before the swap, removed after the unswap
    calls.clear()
    model(torch.randn(2, 32))
    assert calls == []
    copied = Linear.from_linear(nn.Linear(8, 8))  # from_linear keeps the original: the hooks are copies there
    handle = copied.register_forward_hook(lambda *args: calls.append("copy"))
    assert len(copied.to_linear()._forward_hooks) == 1
    handle.remove()
    assert not copied._forward_hooks


def test_a_forward_set_on_the_instance_keeps_the_layer_as_it_is():
    """accelerate's hooks set module.forward on the instance: a swapped layer would still run the old module."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    for layer in model:
        layer.forward = layer.forward  # a bound method of the layer itself, as accelerate's wrapper keeps
    for filter_fn in (None, lambda module, fqn: True):
        report = []
        swap_linear_(model, filter_fn, report=report)
        assert [type(m) for m in model] == [nn.Linear, nn.Linear]
        assert [fqn for fqn, _ in report] == ["0", "1"] and "forward is set on the instance" in report[0][1]
    with pytest.raises(TypeError, match="cannot rebuild this Linear: its forward is set on the instance"):
        Linear.from_linear(model[0])
    swapped = swap_linear_(nn.Sequential(nn.Linear(16, 16)))
    swapped[0].forward = swapped[0].forward
    with pytest.raises(TypeError, match="unswap_linear_: 0: its forward is set on the instance"):
        unswap_linear_(swapped)


def test_from_linear_refuses_a_parametrized_layer():
    linear = nn.Linear(16, 8)
    nn.utils.parametrize.register_parametrization(linear, "weight", nn.Identity())
    with pytest.raises(TypeError, match=r"cannot rebuild this ParametrizedLinear: it is parametrized"):
        Linear.from_linear(linear)


def test_forward_takes_input_by_keyword_as_nn_linear_does():
    linear = nn.Linear(16, 8)
    x = torch.randn(2, 16)
    assert torch.equal(Linear.from_linear(linear)(input=x), linear(input=x))


def test_weight_norm_layers_are_left_with_a_reason():
    model = nn.Sequential(nn.Linear(16, 16), nn.utils.weight_norm(nn.Linear(16, 16)),
                          nn.utils.spectral_norm(nn.Linear(16, 16)))
    x = torch.randn(2, 16)
    before = model(x)
    report = []
    swap_linear_(model, report=report)
    assert [type(m) for m in model] == [Linear, nn.Linear, nn.Linear]
    reason = "its weight is not a Parameter of the layer (weight_norm / spectral_norm recompute it on every call)"
    assert report == [("1", reason), ("2", reason)]
    model.eval()
    assert model(x).shape == before.shape


def test_unswap_refuses_a_parametrized_swapped_layer_before_changing_anything():
    model = swap_linear_(nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8)))
    nn.utils.parametrize.register_parametrization(model[1], "weight", nn.Identity())
    with pytest.raises(TypeError, match="unswap_linear_: 1 is a ParametrizedLinear, a subclass of torch_tma.nn.Linear"):
        unswap_linear_(model)
    assert type(model[0]) is Linear  # nothing was unswapped


def test_swap_transformers_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(config.vocab_size, (2, 10))
    with torch.no_grad():
        before = model(ids).logits
        report = []
        model = swap_linear_(model, report=report)
        assert report == []
        assert sum(isinstance(m, Linear) for m in model.modules()) == 7 * config.num_hidden_layers + 1
        assert torch.equal(model(ids).logits, before)


# ---- CUDA graphs and torch.compile ----------------------------------------------------------------------


@cuda_test
@torch.no_grad()
def test_cuda_graph_reads_new_weights_after_refresh():
    """Capture a decode step of a swapped model, move every weight to new storage (the old poisoned with NaN),
    refresh, and replay the SAME graph: it must compute with the new weights."""
    config, device, dtype = decode_demo.TINY, torch.device("cuda"), torch.bfloat16
    model = swap_linear_(decode_demo.Decoder(config, 32, device=device, dtype=dtype))
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(layers) == 7 * config.num_layers + 1
    prompt = torch.randint(config.vocab_size, (2, 8), device=device)
    session = decode_demo.GreedySession(model, prompt, new_tokens=4)
    session.prefill()
    session.capture()
    slots = [m.weight_map.map.ptr for m in layers]

    def graph_step_matches_stock():
        session.prefill()  # eager, with the current weights: refills the KV cache, feeds the first token
        session.graph.replay()
        ours = session.graph_logits.double().cpu()
        assert torch.isfinite(ours).all(), "the graph read stale (poisoned) weights"
        stock, ref = (
            _stock_step_logits(model.state_dict(), prompt, session.first, device, dtype),
            _stock_step_logits(model.state_dict(), prompt, session.first, "cpu", torch.float64),
        )
        assert decode_demo.logits_error_ratio(ours, stock, ref) <= 2

    graph_step_matches_stock()
    old = []
    for m in layers:
        old.append(m.weight)
        m.weight = nn.Parameter(random_like_weights(m)[0])
    for w in old:
        w.fill_(math.nan)
    refresh(model)
    assert [m.weight_map.map.ptr for m in layers] == slots
    graph_step_matches_stock()


def test_decode_check_fails_on_nan_or_inf_logits():
    stock = torch.randn(3, 2, 50, dtype=torch.float64)
    ref = stock + 0.01 * torch.randn_like(stock)
    ours = stock.clone()
    decode_demo.check_error_ratio(1, decode_demo.logits_error_ratio(ours, stock, ref))  # about 1: passes
    for bad in (math.nan, math.inf):
        ours[1, 0, 7] = bad
        with pytest.raises(decode_demo.CheckFailed, match="batch 4: swapped logits are (nan|inf)x further"):
            decode_demo.check_error_ratio(4, decode_demo.logits_error_ratio(ours, stock, ref))
    with pytest.raises(decode_demo.CheckFailed, match="3.00x further"):
        decode_demo.check_error_ratio(16, 3.0)


def _stock_step_logits(state_dict, prompt, first_token, device, dtype):
    """Logits of one decode step of the plain model with these weights, fed first_token after the prompt."""
    model = decode_demo.Decoder(decode_demo.TINY, 32, device=device, dtype=dtype)
    model.load_state_dict({k: v.to(device, dtype) for k, v in state_dict.items()})
    session = decode_demo.GreedySession(model, prompt.to(device), new_tokens=4)
    session.prefill()
    session.first = first_token.to(device)
    session.reset()
    return session.step().double().cpu()


def _test_compiled_model(device, dtype, **compile_kwargs):
    stock = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 128)).to(device, dtype)
    float64 = nn.Sequential(_float64_copy(stock[0]), nn.SiLU(), _float64_copy(stock[2]))
    model = nn.Sequential(*(Linear.from_linear(m) if isinstance(m, nn.Linear) else m for m in stock))
    refresh(model)  # binds the descriptors on CUDA: compiled code cannot
    compiled = torch.compile(model, fullgraph=True, **compile_kwargs)
    for _ in range(4):  # reduce-overhead records a CUDA graph on a later call: check the replays too
        x = torch.randn(8, 256, device=device, dtype=dtype)
        ours = compiled(x).clone()
        assert decode_demo.logits_error_ratio(ours.double().cpu(), stock(x).double().cpu(), float64(x.double().cpu())) <= 2


def test_compile_fullgraph_cpu():
    _test_compiled_model("cpu", torch.bfloat16)


@cuda_test
def test_compile_fullgraph_cuda():
    _test_compiled_model("cuda", torch.bfloat16)


@cuda_test
def test_compile_reduce_overhead_cuda():
    _test_compiled_model("cuda", torch.bfloat16, mode="reduce-overhead")


# ---- the serving demo -----------------------------------------------------------------------------------


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0),
    reason="with a Hopper GPU the demo runs the full benchmark (benchmarks/bench_decode.py)",
)
def test_decode_demo_without_hopper_says_so_and_fails(tmp_path, capsys):
    assert decode_demo.main(["--out", str(tmp_path), "--batch", "1", "3"]) == 2
    assert "NO HOPPER GPU" in capsys.readouterr().err
    with open(tmp_path / "decode.csv") as f:
        rows = list(csv.DictReader(f))
    errors = {int(r["batch"]): float(r["p50"]) for r in rows if r["metric"] == "logits_error_vs_stock"}
    assert errors.keys() == {1, 3} and all(e <= 2 for e in errors.values())
    assert {(r["provider"], int(r["batch"])) for r in rows if r["metric"] == "tokens_per_s"} == {
        (p, b) for p in ("stock", "torch_tma") for b in (1, 3)
    }
    assert (tmp_path / "decode.png").stat().st_size > 0
    # --plot redraws the PNG from the CSV alone, from the same medians
    results, device_name, _ = decode_demo.results_from_csv(tmp_path / "decode.csv")
    assert device_name.startswith("CPU") and {(r.provider, r.batch) for r in results} == {
        (p, b) for p in ("stock", "torch_tma") for b in (1, 3)}
    tokens = {(r["provider"], int(r["batch"])): float(r["p50"]) for r in rows if r["metric"] == "tokens_per_s"}
    for r in results:
        assert r.tokens_per_s == pytest.approx(tokens[r.provider, r.batch], rel=1e-4)
    (tmp_path / "decode.png").unlink()
    assert decode_demo.main(["--plot", str(tmp_path / "decode.csv")]) == 0
    assert (tmp_path / "decode.png").stat().st_size > 0


def _sessions_of_a_run(monkeypatch, device, dtype, ref_dtype, new_tokens, check_steps):
    """decode_demo.run on a tiny model at batch 1; returns every GreedySession it made, in order."""
    sessions = []
    init = decode_demo.GreedySession.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sessions.append(self)

    monkeypatch.setattr(decode_demo.GreedySession, "__init__", recording_init)
    _, checks, _, _, _ = decode_demo.run(decode_demo.TINY, [1], 8, new_tokens, 1, check_steps, torch.device(device),
                                         dtype, ref_dtype, seed=0)
    assert checks[1] <= 2
    return sessions


@torch.inference_mode()
def test_decode_demo_stock_sessions_keep_stock_layers_cpu(monkeypatch):
    """Without graphs the stock sessions step eagerly: the swap must not reach the model they decode."""
    stock, reference, swapped = _sessions_of_a_run(monkeypatch, "cpu", torch.float32, torch.float64, 4, 4)
    kinds = lambda s: {type(m) for m in s.model.modules() if isinstance(m, nn.Linear)}
    assert kinds(stock) == {nn.Linear} and kinds(swapped) == {Linear}


@cuda_test
@torch.inference_mode()
def test_decode_demo_few_new_tokens_cuda(monkeypatch):
    """The fewest new tokens the demo takes: every session's graph warm-up stays inside the KV cache and RoPE table
    (its warm-up steps decode from just after prefill, not from where the eager check left off)."""
    n = decode_demo.GRAPH_WARMUP
    for s in _sessions_of_a_run(monkeypatch, "cuda", torch.bfloat16, torch.float64, n, n):
        if s.graph is not None:
            assert int(s.pos) == s.prompt_len  # reset after the capture
    torch.cuda.synchronize()


def test_demo_arguments_checked():
    for bad in (["--new-tokens", str(decode_demo.GRAPH_WARMUP - 1)], ["--check-steps", "0"], ["--batch", "1", "-4"]):
        with pytest.raises(SystemExit) as e:
            decode_demo._parse(bad)
        assert e.value.code == 2
    assert decode_demo._parse(["--new-tokens", str(decode_demo.GRAPH_WARMUP)]).new_tokens == decode_demo.GRAPH_WARMUP


def test_main_command_help_and_unknown(capsys):
    from torch_tma.__main__ import main
    assert main(["--help"]) == 0 and "python -m torch_tma" in capsys.readouterr().out
    assert main(["bogus"]) == 2 and "unknown command 'bogus'" in capsys.readouterr().err


# ---- what nn.Linear supports, after a swap ----------------------------------------------------------------


_loaded_modules = []  # what _record_module saw (module level: a pickled model takes its hook along)


def _record_module(module, *args):
    _loaded_modules.append(module)


def test_a_load_state_dict_pre_hook_follows_the_swap():
    """register_load_state_dict_pre_hook holds its module weakly (torch's _WrappedHook): after a swap it must call
    the new layer, and a load, a deepcopy and a pickle must not meet a dead module."""
    model = nn.Sequential(nn.Linear(16, 8))
    seen = _loaded_modules
    seen.clear()
    model[0].register_load_state_dict_pre_hook(_record_module)
    swap_linear_(model)
    gc.collect()  # the dropped nn.Linear is gone
    model.load_state_dict(model.state_dict())
    assert seen == [model[0]] and isinstance(model[0], Linear)
    copy.deepcopy(model)
    clone = pickle.loads(pickle.dumps(model))
    clone.load_state_dict(model.state_dict())
    assert seen[-1] is clone[0]
    unswap_linear_(model)
    gc.collect()
    model.load_state_dict(model.state_dict())
    assert seen[-1] is model[0] and type(model[0]) is nn.Linear


def test_a_data_parallel_replica_binds_its_own_descriptor():
    layer = Linear(16, 8)
    sentinel = object()
    layer._weight_map, layer._weight_key = sentinel, ("key",)
    replica = layer._replicate_for_data_parallel()
    assert (replica._weight_map, replica._weight_key) == (None, None)
    assert (layer._weight_map, layer._weight_key) == (sentinel, ("key",))  # the original keeps (and owns) its own


def test_a_compiled_layer_copies_and_pickles():
    layer = Linear(16, 8)
    layer.compile()  # sets a call nn.Module's own __getstate__ leaves out
    x = torch.randn(2, 16)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert torch.equal(clone.weight, layer.weight) and torch.equal(clone(x), F.linear(x, layer.weight, layer.bias))


def test_swap_skips_tensor_parallel_layers():
    """A DTensor weight (parallelize_module): the op has no sharding rule, so the swap leaves the layer and says why
    (a fake two-rank process group, in a subprocess: the group is global)."""
    code = (
        "import torch, torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2)\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel\n"
        "m = torch.nn.Sequential(torch.nn.Linear(16, 8))\n"
        "parallelize_module(m, init_device_mesh('cpu', (2,)), {'0': ColwiseParallel()})\n"
        "from torch_tma.nn import swap_linear_\n"
        "report = []\n"
        "swap_linear_(m, report=report)\n"
        "print(type(m[0]).__module__, report)\n"
        "dist.destroy_process_group()\n"
    )
    assert python_output(code).strip() == ("torch.nn.modules.linear [('0', 'its weight is a DTensor (tensor "
                                           "parallel): tma::linear has no sharding rule')]")
