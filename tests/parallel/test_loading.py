"""Per-rank loading: lazy safetensors slices (no full tensor read per rank), the TP sizes a
checkpoint allows (heads, INT4 groups) and clear errors for the others. No processes."""

import pytest
import torch
from safetensors import safe_open

from app.models import loader
from app.models.loader import safetensors_files
from app.models.parallel import TPContext
from app.models.parallel_load import LazyTensor
from app.quant.load import load_model


class Recorder:
    """A safetensors-slice stand-in that records what is read."""

    def __init__(self, t: torch.Tensor):
        self.t, self.reads = t, []

    def __getitem__(self, key):
        self.reads.append(key)
        return self.t[key]


def test_lazy_tensor_narrows_before_reading():
    full = torch.arange(24.0).view(4, 6)
    src = Recorder(full)
    lazy = LazyTensor(src, (4, 6)).narrow(1, 2, 3)[1:3].to(torch.float64)
    assert lazy.shape == (2, 3) and src.reads == []
    out = torch.zeros(2, 3, dtype=torch.float64)
    out.copy_(lazy)  # any torch function reads it (__torch_function__)
    assert torch.equal(out, full[1:3, 2:5].double())
    assert src.reads == [(slice(1, 3), slice(2, 5))]
    with pytest.raises(ValueError, match="outside"):
        lazy.narrow(0, 1, 2)


def _checkpoint(path):
    with safe_open(safetensors_files(path)[0], framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118


def test_rank_reads_only_its_slices(checkpoint_factory, monkeypatch):
    path = checkpoint_factory("llama")
    read = []
    materialize = LazyTensor.materialize

    def spy(self):
        t = materialize(self)
        read.append(t.numel())
        return t

    monkeypatch.setattr(LazyTensor, "materialize", spy)
    model, cfg = load_model(path, torch.float32, "cpu", TPContext(1, 2))
    params = dict(model.named_parameters())
    assert sum(read) == sum(p.numel() for p in params.values())  # nothing beyond the shard
    full = _checkpoint(path)
    attn = "model.layers.0.self_attn"
    o = params[f"{attn}.o_proj.weight"]
    assert torch.equal(o, full[f"{attn}.o_proj.weight"][:, 32:])  # row-parallel: columns
    qkv = params[f"{attn}.qkv_proj.weight"]  # rank 1: q heads 2-3, kv head 1
    assert torch.equal(qkv[:32], full[f"{attn}.q_proj.weight"][32:])
    assert torch.equal(qkv[32:48], full[f"{attn}.k_proj.weight"][16:])
    emb = params["model.embed_tokens.weight"]
    assert torch.equal(emb, full["model.embed_tokens.weight"][160:])


def test_heads_must_split_evenly(checkpoint_factory):
    with pytest.raises(ValueError, match="num_attention_heads=4 .* tensor_parallel_size=3"):
        loader.build_model(
            loader.ModelConfig.from_path(checkpoint_factory("llama")),
            torch.float32,
            "cpu",
            TPContext(0, 3),
        )


@pytest.fixture(scope="module")
def int4_llama(checkpoint_factory, tmp_path_factory):
    from app.quant.quantize_cli import quantize_checkpoint

    out = str(tmp_path_factory.mktemp("int4_llama"))
    quantize_checkpoint(checkpoint_factory("llama"), out, "rtn", 32, symmetric=False)
    return out


def test_int4_groups_never_straddle_ranks(int4_llama):
    # o_proj has 64 input features in groups of 32: TP=2 keeps whole groups, TP=4 cannot.
    model, _ = load_model(int4_llama, torch.float32, "cpu", TPContext(1, 2))
    o = model.model.layers[0].self_attn.o_proj
    assert (o.in_features, o.scales.shape[1]) == (32, 1)
    with pytest.raises(ValueError, match="in_features=16 per rank .* group 32"):
        load_model(int4_llama, torch.float32, "cpu", TPContext(0, 4))


def test_expert_parallel_rank_builds_and_reads_only_its_experts(moe_factory):
    model, _ = load_model(
        moe_factory("glm4_moe"), torch.float32, "cpu", TPContext(1, 2, expert_parallel=True)
    )
    names = {n for n, _ in model.named_parameters() if ".experts." in n}
    owned = {int(n.split(".experts.")[1].split(".")[0]) for n in names}
    assert owned == set(range(8, 16))  # 16 experts, the second half on rank 1
